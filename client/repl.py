"""The interactive `kvwake chat`: a prompt, streamed replies, slash commands.

A failed turn or command prints one `Error: ...` line and the prompt comes
back; the session is untouched. Ctrl-C during a reply cancels it (what was
generated stays in the session); Ctrl-C or Ctrl-D at the prompt leaves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from kvwake.client.client import Client
from kvwake.client.output import echo_reply, echo_stream, error_line, fields, short
from kvwake.client.wire import ClientConnectionError
from kvwake.errors import KvwakeError

__all__ = ["HELP", "Repl"]

HELP = """\
/sleep              write the session's KV to disk and free its memory
/wake [SNAPSHOT]    restore it now (any message wakes it too)
/fork [NEW_ID]      branch into a new session and switch to it
/checkpoint LABEL   a labeled snapshot that gc keeps
/info               the session's state
/help               this list
/quit               leave (the session stays in the daemon)"""


class Repl:
    """Reads lines with `read` (default: input, with line editing on a terminal) and chats on one session."""

    def __init__(self, client: Client, session_id: str, options: dict[str, Any], *, stream: bool = True,
                 read: Callable[[str], str] | None = None) -> None:
        self.client, self.session_id, self.options, self.stream = client, session_id, options, stream
        self.read = read or _input()
        self.commands: dict[str, Callable[[str], bool]] = {
            "/sleep": self.sleep, "/wake": self.wake, "/fork": self.fork, "/checkpoint": self.checkpoint,
            "/info": self.info, "/help": self.help, "/quit": self.quit, "/exit": self.quit,
        }

    def run(self) -> None:
        while True:
            try:
                line = self.read(f"{self.session_id}> ").strip()
            except (EOFError, KeyboardInterrupt):
                click.echo()
                return
            if not line:
                continue
            try:
                if line.startswith("/"):
                    name, _, arg = line.partition(" ")
                    command = self.commands.get(name)
                    if command is None:
                        click.echo(f"Error: unknown command {name}; /help lists them", err=True)
                    elif not command(arg.strip()):
                        return
                else:
                    self.turn(line)
            except (KvwakeError, ClientConnectionError, TimeoutError) as exc:
                click.echo(f"Error: {error_line(exc)}", err=True)

    def turn(self, text: str) -> None:
        if not self.stream:
            echo_reply(self.client.chat(self.session_id, text, **self.options))
            return
        stream = self.client.chat(self.session_id, text, stream=True, **self.options)
        try:
            echo_stream(stream)
        except KeyboardInterrupt:
            stream.close()
            click.echo("\n[interrupted]", err=True)

    # Each command returns False to leave the loop.

    def sleep(self, arg: str) -> bool:
        r = self.client.sleep(self.session_id)
        if r.get("already_asleep"):
            click.echo(f"[already asleep; snapshot {short(r.get('snapshot_id'), 21)}]")
        else:
            click.echo(f"[asleep: {r['tokens']} tokens in snapshot {r['snapshot_id']}, {r['ms']:.0f} ms]")
        return True

    def wake(self, arg: str) -> bool:
        r = self.client.wake(self.session_id, arg or None)
        if r.get("already_awake"):
            click.echo("[already awake]")
        else:
            click.echo(f"[awake: {r['tokens']} tokens from snapshot {r['snapshot_id']}, {r['ms']:.0f} ms]")
        return True

    def fork(self, arg: str) -> bool:
        r = self.client.fork(self.session_id, arg or None)
        click.echo(f"[forked {self.session_id} into {r['session_id']}; now chatting in {r['session_id']}]")
        self.session_id = r["session_id"]
        return True

    def checkpoint(self, arg: str) -> bool:
        if not arg:
            click.echo("Error: /checkpoint needs a LABEL", err=True)
            return True
        r = self.client.checkpoint(self.session_id, arg)
        click.echo(f"[checkpoint {r['label']!r}: snapshot {r['snapshot_id']}]")
        return True

    def info(self, arg: str) -> bool:
        info = self.client.session_info(self.session_id)
        fields([(k, v) for k, v in info.items()])
        return True

    def help(self, arg: str) -> bool:
        click.echo(HELP)
        return True

    def quit(self, arg: str) -> bool:
        return False


def _input() -> Callable[[str], str]:
    """input() with line editing and history when stdin is a terminal."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it is what turns editing on)
        except ImportError:
            pass
    return input
