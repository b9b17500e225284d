"""Start a daemon in the background when none answers (opt-in: `Client(autostart=True)` or KVWAKE_AUTOSTART=1).

The daemon is `python -m kvwake.client.cli serve --socket SOCKET`, detached: a
short-lived launcher starts it in its own session and exits, so it outlives
the client and is no child of it. Every other setting (model, data dir,
config file) comes from the environment and config file, as for `kvwake serve`.
Its output goes to `<data dir>/kvwake.log`. A lock file next to the socket keeps
two clients from starting two daemons; the second one waits for the first's.
Ready means the socket accepts connections (the daemon listens only once the
model is loaded).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kvwake.client.paths import pid_alive, resolve_data_dir
from kvwake.client.wire import ClientConnectionError

__all__ = ["autostart_enabled", "ensure_daemon"]

# Runs in the launcher: start the daemon in a new session with its output in the log, print its pid.
_LAUNCH = (
    "import subprocess, sys\n"
    "log = open(sys.argv[1], 'ab')\n"
    "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)\n"
    "print(p.pid)\n"
)


def autostart_enabled() -> bool:
    """KVWAKE_AUTOSTART=1 (or true/yes/on) turns autostart on for clients that do not say."""
    return os.environ.get("KVWAKE_AUTOSTART", "").strip().lower() in {"1", "true", "yes", "on"}


def answers(path: Path) -> bool:
    """Whether something accepts connections on the socket."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".autostart.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tail(log: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def ensure_daemon(path: Path, timeout: float = 120.0) -> int | None:
    """Start a daemon on `path` unless one answers; wait until it does.

    Returns the started daemon's pid (None if one was already answering).
    Raises ClientConnectionError, with the end of the daemon's log, if it exits
    or is not listening within `timeout` seconds (the first start converts the
    default model, which takes a while).
    """
    with _locked(path):
        if answers(path):
            return None
        log = resolve_data_dir() / "kvwake.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "kvwake.client.cli", "serve", "--socket", str(path)]
        launched = subprocess.run([sys.executable, "-c", _LAUNCH, str(log), *cmd], capture_output=True,
                                  text=True, timeout=60, stdin=subprocess.DEVNULL)
        if launched.returncode != 0 or not launched.stdout.strip().isdigit():
            raise ClientConnectionError(f"could not start `kvwake serve`: {launched.stderr.strip()[-500:]}")
        pid = int(launched.stdout)
        deadline = time.monotonic() + timeout
        while not answers(path):
            if not pid_alive(pid) or _zombie(pid):
                raise ClientConnectionError(f"autostarted daemon (pid {pid}) exited; see {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise ClientConnectionError(f"autostarted daemon (pid {pid}) not listening on {path} after "
                                            f"{timeout:.0f}s; see {log}:\n{_tail(log)}")
            time.sleep(0.05)
        return pid


def _zombie(pid: int) -> bool:
    """A dead daemon that nobody has reaped yet (Linux only; elsewhere pid_alive is enough)."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False
