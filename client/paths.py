"""Where the daemon is: the socket, the data dir and the status file, resolved as `kvwake serve` does.

Order (DESIGN.md, "Paths and settings"): an explicit argument > environment
(`KVWAKE_SOCKET`, `KVWAKE_DATA_DIR`) > the config file's `socket` / `data_dir`
keys (`KVWAKE_CONFIG` or `<user config dir>/kvwake/config.toml`) > platformdirs
defaults (kvwake.paths, shared with the daemon). The daemon resolves settings in
kvwake.daemon.config, which the client must not import (it pulls in the daemon
package); tests check the two agree.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from kvwake.paths import default_config, default_data_dir, default_socket

__all__ = [
    "config_value",
    "default_data_dir",
    "default_socket",
    "pid_alive",
    "read_status_file",
    "resolve_data_dir",
    "resolve_socket",
    "status_file",
]


def config_value(key: str) -> Any:
    """A top-level key of the daemon's config file, or None. Raises ValueError if the file is not TOML."""
    path = default_config()
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text()).get(key)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _resolve(explicit: str | os.PathLike[str] | None, env: str, key: str, default: Path) -> Path:
    value = explicit or os.environ.get(env) or config_value(key)
    return Path(str(value)).expanduser() if value else default


def resolve_socket(socket: str | os.PathLike[str] | None = None) -> Path:
    """The socket to connect to: `socket` > KVWAKE_SOCKET > config file > platform default."""
    return _resolve(socket, "KVWAKE_SOCKET", "socket", default_socket())


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The daemon's data dir: `data_dir` > KVWAKE_DATA_DIR > config file > platform default."""
    return _resolve(data_dir, "KVWAKE_DATA_DIR", "data_dir", default_data_dir())


def status_file(socket: Path) -> Path:
    """`kvwake serve` writes {pid, socket, version, model, bundle_hash, started} here."""
    return socket.with_suffix(".json")


def read_status_file(socket: Path) -> dict[str, Any] | None:
    """The status file's contents, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(status_file(socket).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: Any) -> bool:
    """Whether a process with this pid exists (it may belong to another user)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
