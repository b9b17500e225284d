"""Take the listening socket a service manager passed in (systemd socket activation).

The protocol (sd_listen_fds(3), as systemd implements it):

- The manager binds and listens on the socket itself (kvwake.socket:
  `ListenStream=%t/kvwake/kvwake.sock`), then on the first connection (or at
  start) forks the service and, before exec, sets:
  - `LISTEN_PID`: the pid of the process the fds are meant for. Any other
    process (a child that inherited the environment) must ignore them.
  - `LISTEN_FDS`: how many fds were passed; they are consecutive, starting at
    fd 3 (`SD_LISTEN_FDS_START`). Missing or 0: nothing was passed.
  - `LISTEN_FDNAMES` (optional): colon-separated names, one per fd
    (`FileDescriptorName=`, by default the socket unit's name).
- The service takes the fds it wants, marks them close-on-exec (they were left
  inheritable for the exec) and unsets the three variables so its own children
  do not see them (`sd_listen_fds(1)`); the variables are unset whatever the
  outcome, as sd_listen_fds does.

kvwake takes the first passed fd that is a listening AF_UNIX stream socket and
leaves the others alone. The manager keeps its own copy of the socket: when
the daemon exits, connections queue in it until the next activation, so the
daemon must not unlink the socket file.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["SD_LISTEN_FDS_START", "ActivationError", "listen_socket_from_env", "socket_path"]

SD_LISTEN_FDS_START = 3
VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
_MAX_FDS = 1 << 16  # far above any real unit; guards against a garbage count


class ActivationError(ValueError):
    """LISTEN_PID / LISTEN_FDS / LISTEN_FDNAMES are malformed, or no passed fd is a usable socket."""


def _parse_count(name: str, value: str, low: int, high: int) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise ActivationError(f"{name}={value!r} is not a decimal integer") from None
    if not low <= n <= high:
        raise ActivationError(f"{name}={value!r} is out of range ({low}..{high})")
    return n


def _passed_fds(environ: MutableMapping[str, str]) -> list[tuple[int, str]]:
    """(fd, name) for each fd passed to this process; [] when none were, or they were meant for another pid."""
    pid_value = environ.get("LISTEN_PID")
    if pid_value is None:
        return []
    if _parse_count("LISTEN_PID", pid_value, 1, 1 << 31) != os.getpid():
        return []
    n = _parse_count("LISTEN_FDS", environ.get("LISTEN_FDS", "0"), 0, _MAX_FDS)
    if n == 0:
        return []
    names_value = environ.get("LISTEN_FDNAMES")
    names = names_value.split(":") if names_value is not None else ["unknown"] * n
    if len(names) != n:
        raise ActivationError(f"LISTEN_FDNAMES names {len(names)} fds but LISTEN_FDS={n}")
    return [(SD_LISTEN_FDS_START + i, names[i]) for i in range(n)]


def _is_listening_unix_stream(fd: int) -> bool:
    probe = socket.socket(fileno=fd)
    try:
        return (probe.family == socket.AF_UNIX and probe.type == socket.SOCK_STREAM
                and probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 0)
    finally:
        probe.detach()  # only a look: the fd stays open and unowned


def listen_socket_from_env(environ: MutableMapping[str, str] = os.environ) -> socket.socket | None:
    """The listening socket passed by the service manager, or None if none was passed to this process.

    Takes the first passed fd that is a listening AF_UNIX stream socket and
    returns it non-blocking and close-on-exec. Always removes LISTEN_PID,
    LISTEN_FDS and LISTEN_FDNAMES from `environ` (with os.environ, from the
    process environment too). Raises ActivationError when the variables are
    malformed, a passed fd is not open, or fds were passed but none is a
    listening Unix stream socket.
    """
    try:
        passed = _passed_fds(environ)
    finally:
        for name in VARIABLES:
            environ.pop(name, None)
    modes = {}
    for fd, name in passed:
        try:
            modes[fd] = os.fstat(fd).st_mode
        except OSError as exc:
            raise ActivationError(f"fd {fd} ({name}) from LISTEN_FDS is not open: {exc.strerror}") from None
        os.set_inheritable(fd, False)  # sd_listen_fds sets FD_CLOEXEC on every passed fd
    for fd, _name in passed:
        if stat.S_ISSOCK(modes[fd]) and _is_listening_unix_stream(fd):
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            return sock
    if passed:
        raise ActivationError(f"LISTEN_FDS passed {len(passed)} fd(s) ({', '.join(n for _, n in passed)}) "
                              "but none is a listening AF_UNIX stream socket")
    return None


def socket_path(sock: socket.socket) -> Path | None:
    """The filesystem path a Unix socket is bound to; None for an unbound or abstract-namespace socket."""
    name = sock.getsockname()
    if isinstance(name, bytes):
        name = name.decode(errors="surrogateescape")
    if not name or name.startswith("\0"):
        return None
    return Path(name)
