"""The `kvwake` group's global options, handed to every command as click's `obj`.

Its own module so that client/cli.py and the command modules it registers
(client/cli_store.py) both import it, and neither imports the other's module
for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from kvwake.client.client import Client

__all__ = ["Options"]


@dataclass
class Options:
    """`--socket` and `--autostart` as given (None: the environment, config file or default decides)."""

    socket: str | None
    autostart: bool | None

    def client(self) -> Client:
        """A client for the daemon these options name; an unreadable config file is a ClickException."""
        try:
            return Client(self.socket, autostart=self.autostart)
        except ValueError as exc:  # an unreadable config file
            raise click.ClickException(str(exc)) from None
