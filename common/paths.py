"""Platform default locations, shared by the daemon and the client (imports only platformdirs)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import platformdirs

__all__ = ["default_cache_dir", "default_config", "default_data_dir", "default_socket"]


def default_socket() -> Path:
    with warnings.catch_warnings():  # no XDG_RUNTIME_DIR (containers, CI): platformdirs falls back and warns
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir("kvwake")) / "kvwake.sock"


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("kvwake"))


def default_cache_dir() -> Path:
    """What can be made again but is slow to make (MLX's compiled kernels): kept across reboots."""
    return Path(platformdirs.user_cache_dir("kvwake"))


def default_config() -> Path:
    return Path(os.environ.get("KVWAKE_CONFIG") or Path(platformdirs.user_config_dir("kvwake")) / "config.toml")
