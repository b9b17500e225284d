"""The `kvwake` command."""

from __future__ import annotations

import sys

import click

__all__ = ["main"]


@click.group()
@click.version_option(package_name="kvwake")
def main() -> None:
    """kvwake: an agent memory daemon for MLX."""


@main.command()
@click.option("--socket", "socket_path", type=click.Path(), help="Unix socket to serve (env KVWAKE_SOCKET).")
@click.option("--data-dir", type=click.Path(), help="Store and converted models (env KVWAKE_DATA_DIR).")
@click.option("--model", help="mlx-lm model folder or hub id (env KVWAKE_MODEL); default SmolLM2-135M-Instruct.")
@click.option("--config", "config_file", type=click.Path(), help="TOML config file (env KVWAKE_CONFIG).")
@click.option("--block-tokens", type=int, help="Tokens per stored block (fixed per store).")
@click.option("--hot-budget-bytes", type=int, help="KV bytes of hot sessions before LRU ones sleep.")
@click.option("--idle-timeout", "idle_timeout_s", type=float, help="Seconds idle before a session sleeps.")
@click.option("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR.")
def serve(**flags: object) -> None:
    """Run the daemon in the foreground.

    Example: kvwake serve --model ~/models/Qwen3-4B-4bit
    """
    from pathlib import Path

    from kvwake.daemon.config import load_settings
    from kvwake.daemon.serve import run

    config = flags.pop("config_file")
    flags["socket"] = flags.pop("socket_path")
    try:
        settings = load_settings(flags, Path(str(config)) if config else None)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(run(settings))


if __name__ == "__main__":
    main()
