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
    "openai_config",
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


def openai_config(socket: str | Path | None = None) -> dict[str, str]:
    """`base_url` and `api_key` of the running daemon's HTTP API, for `openai.OpenAI(**openai_config())`.

    The URL comes from the status file next to the socket (the daemon must serve `--http`); the key
    from KVWAKE_HTTP_TOKEN, else the token file the daemon names there. Raises LookupError when there
    is no HTTP API to find, PermissionError when the token file is not readable.
    """
    path = resolve_socket(socket)
    info = (read_status_file(path) or {}).get("http")
    if not isinstance(info, dict) or not isinstance(info.get("url"), str):
        raise LookupError(f"no daemon serves HTTP for {path} (start it with `kvwake serve --http PORT`)")
    token = os.environ.get("KVWAKE_HTTP_TOKEN")
    if token is None and info.get("token_file"):
        token = Path(info["token_file"]).read_text().strip()
    return {"base_url": info["url"], "api_key": token or "none"}
