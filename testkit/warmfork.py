"""Test daemons forked from one warm parent process, not started as fresh interpreters.

Most of a tiny-model daemon's start is importing MLX, mlx-lm and transformers. The warm parent
(`python -m testkit.warmfork`, one per test process, started at its first daemon) imports them once, as
`kvwake serve` would (its `lighten_imports` first), and forks each daemon from there; the child then runs
`kvwake serve` with the daemon's own arguments, environment, working directory and log, as
`subprocess.Popen` would have. `ForkedProcess` answers the part of Popen's interface the tests use.
Only tests fork (tests/conftest.py calls `fork_daemons`); bench/ measures starts and memory, so its
daemons start fresh, as do those made with `Daemon(fresh=True)`.

A daemon is forked only where that child is the process a fresh start would give (`can_fork`): on
Linux, MLX on its CPU device (a GPU context does not survive a fork; macOS forbids forking its
Objective-C runtime once initialised), no import_frameworks knob (the warm parent's imports were
lightened), and an environment equal to the warm parent's in all its imports may read (`_read_at_import`):
another PYTHONPATH, say, starts a fresh interpreter.

Wire (the test process's pipes to the warm parent): one JSON object a line each way. Requests:
`{"argv", "env", "cwd", "log"}`; answers: `{"ready", "why", "set_by_imports"}` once at the start,
`{"started": pid}` for each request in order, `{"exited": pid, "code": code}` when a child ends (Popen's
returncode: negative for a signal). The warm parent reaps its children, so a child's exit code reaches
the test process only through it; the test process keeps them by fork (`Children`), since pids are reused.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["Children", "ForkedProcess", "WarmParent", "can_fork", "cuda_installed", "fork_daemons", "stop_forking",
           "warm_parent"]

REPO = Path(__file__).resolve().parent.parent
PRELOAD = ("kvwake.client.cli", "kvwake.daemon.serve")


class WarmParentError(RuntimeError):
    """The warm parent exited or answered out of turn."""


class Children:
    """The warm parent's children by the order of their forks, not by pid: a pid is reused once its process
    is reaped, which may happen within a run (the pid space is shared with every thread of the machine)."""

    def __init__(self) -> None:
        self.forks = 0
        self.holder: dict[int, int] = {}  # pid: the fork that has it now
        self.exits: dict[int, int] = {}  # fork: its exit code

    def started(self, pid: int) -> int:
        self.forks += 1
        self.holder[pid] = self.forks
        return self.forks

    def exited(self, pid: int, code: int) -> None:
        self.exits[self.holder[pid]] = code  # its "started" came first, and no later child has the pid yet


class WarmParent:
    """The test process's side: starts the warm parent, sends it requests, keeps its children's exits."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env  # what its imports see
        self.proc = subprocess.Popen([sys.executable, "-m", "testkit.warmfork"], cwd=REPO, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        hello = self._line()
        self.ready, self.why, self.set_by_imports = hello["ready"], hello["why"], hello["set_by_imports"]
        self.children = Children()
        self.started: list[tuple[int, int]] = []  # (pid, fork) answered, not yet taken
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # one request at a time: answers come in order
        threading.Thread(target=self._read, name="warmfork-reader", daemon=True).start()

    def _line(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise WarmParentError(f"the warm parent exited ({self.proc.wait()})")
        return json.loads(line)

    def _read(self) -> None:
        while True:
            try:
                message = self._line()
            except WarmParentError:
                with self.changed:
                    self.changed.notify_all()
                return
            with self.changed:
                if "exited" in message:
                    self.children.exited(message["exited"], message["code"])
                else:
                    self.started.append((message["started"], self.children.started(message["started"])))
                self.changed.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        """A child running `argv` (its argv[0] is the program's name) under `env` in `cwd`, writing to `log`."""
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}) + "\n"
        with self.lock:
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
            with self.changed:
                if not self.changed.wait_for(lambda: self.started or self.proc.poll() is not None, timeout=60):
                    raise WarmParentError("the warm parent did not answer a fork in 60 s")
                if not self.started:
                    raise WarmParentError(f"the warm parent exited ({self.proc.returncode})")
                return ForkedProcess(self, *self.started.pop(0), argv)

    def exit_code(self, fork: int, timeout: float | None) -> int | None:
        """The exit code of the `fork`th child, waiting up to `timeout` seconds for it (None: for ever; 0: not
        at all)."""
        with self.changed:
            exits = self.children.exits
            self.changed.wait_for(lambda: fork in exits or self.proc.poll() is not None, timeout=timeout)
            if fork not in exits and self.proc.poll() is not None:
                raise WarmParentError(f"the warm parent exited ({self.proc.returncode}) before its child {fork}")
            return exits.get(fork)


class ForkedProcess:
    """A forked daemon, with Popen's pid, returncode, poll, wait, send_signal, terminate and kill."""

    def __init__(self, parent: WarmParent, pid: int, fork: int, args: list[str]) -> None:
        self.parent, self.pid, self.fork, self.args = parent, pid, fork, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.parent.exit_code(self.fork, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.parent.exit_code(self.fork, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # As Popen does: never signal a pid once its exit is known (the number may be another's by then).
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_PARENT: list[WarmParent] = []
_FORKING: dict[str, dict[str, str]] = {}  # "env": the warm parent's environment, while forking is on


def fork_daemons() -> None:
    """Fork this process's daemons from a warm parent from now on, where `can_fork` allows: tests/conftest.py
    turns it on; bench/ never does, since it measures daemons' starts and their memory. The warm parent,
    started at the first daemon, gets this moment's environment: not that of the test it starts in, which
    may have changed it for a while (its daemons, and only those, would then differ from the warm parent)."""
    if os.environ.get("TESTKIT_FRESH_DAEMONS") != "1":
        _FORKING["env"] = dict(os.environ)


def stop_forking() -> None:
    """The warm parent, if started, leaves (its input closed) and is waited for; its children stay."""
    _FORKING.clear()
    while _PARENT:
        parent = _PARENT.pop()
        parent.proc.stdin.close()
        parent.proc.wait(30)
        parent.proc.stdout.close()


def warm_parent() -> WarmParent:
    """This test process's warm parent, started at the first call."""
    if not _PARENT:
        _PARENT.append(WarmParent(_FORKING["env"]))
    return _PARENT[0]


def can_fork(argv: list[str], env: dict[str, str]) -> bool:
    """Whether a daemon of these arguments and environment may be forked from the warm parent."""
    if "env" not in _FORKING or platform.system() != "Linux" or cuda_installed():
        return False
    config = Path(env["KVWAKE_CONFIG"]) if env.get("KVWAKE_CONFIG") else None
    if any("import_frameworks" in a for a in argv) or "KVWAKE_IMPORT_FRAMEWORKS" in env or (
            config is not None and config.exists() and "import_frameworks" in config.read_text()):
        return False  # the warm parent's imports were lightened; this daemon's would not be
    parent = warm_parent()
    if not parent.ready or any(env.get(k, v) != v for k, v in parent.set_by_imports.items()):
        return False
    return _read_at_import(env, parent.set_by_imports) == _read_at_import(parent.env, parent.set_by_imports)


@functools.cache
def cuda_installed() -> bool:
    """Whether MLX's CUDA backend (mlx-cuda-12, mlx-cuda-13, ...) is installed: MLX then runs on the GPU.
    Asked of the package metadata, so that no warm parent is started only to make a CUDA context."""
    return any((dist.metadata["Name"] or "").lower().startswith("mlx-cuda") for dist in importlib.metadata.distributions())


def _read_at_import(env: dict[str, str], set_by_imports: dict[str, str]) -> dict[str, str]:
    """The environment a daemon's imports may read: all but what is read at its start (the settings':
    KVWAKE_* and the AWS keys of the shared tier; MLX's kernel cache folder, which `serve` sets before MLX
    compiles a kernel), pytest's name of the running test, and what the imports set themselves (an
    in-process test leaves it in this process's environment)."""
    from kvwake.daemon.config import ENV as SETTINGS_ENV

    later = {"PYTEST_CURRENT_TEST", "MLX_PTX_CACHE_DIR", *SETTINGS_ENV.values(), *set_by_imports}
    return {k: v for k, v in env.items() if not k.startswith("KVWAKE_") and k not in later}


# The warm parent's side.


SET_BY_IMPORTS: dict[str, str] = {}  # in the warm parent: the environment its imports added (os.environ.setdefault)


def _preload() -> tuple[bool, str]:
    """Import what `kvwake serve` imports, as it does; whether its children may use them."""
    from kvwake.daemon.imports import lighten_imports

    before = dict(os.environ)
    lighten_imports()
    for name in PRELOAD:
        __import__(name)
    SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if k not in before})
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return False, f"MLX's default device is {mx.default_device()}: a GPU context does not survive a fork"
    return True, ""


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _serve() -> dict[str, Any] | None:
    """Fork a child per request; in the child, return its request. None once the test process has gone."""
    ready, why = _preload()
    _say({"ready": ready, "why": why, "set_by_imports": SET_BY_IMPORTS})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup fd
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap()
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                return json.loads(line)
            _say({"started": pid})


def _run(request: dict[str, Any]) -> None:
    """In the child: become the daemon `subprocess.Popen` would have started; never returns."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in SET_BY_IMPORTS.items():  # as the imports would have, in a fresh process
        os.environ.setdefault(key, value)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd, to in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, to)
    os.close(null)
    os.close(log)
    sys.argv = request["argv"]
    from kvwake.client.cli import main

    main(args=request["argv"][1:], prog_name=request["argv"][0])  # raises SystemExit, or leaves by os._exit


if __name__ == "__main__":
    request = _serve()
    if request is not None:
        _run(request)
