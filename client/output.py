"""How the CLI prints: JSON for scripts, aligned text for people, a spinner on long calls."""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import click

__all__ = [
    "echo_json",
    "echo_reply",
    "echo_stream",
    "error_line",
    "fields",
    "human_bytes",
    "human_duration",
    "json_option",
    "short",
    "spinner",
    "table",
    "tool_call_line",
]

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")


def echo_json(data: Any) -> None:
    """One JSON document on stdout (json.loads reads it back)."""
    click.echo(json.dumps(data, indent=2, default=str, ensure_ascii=False))


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d" if days else "", f"{hours}h" if hours else "", f"{minutes}m" if minutes else "", f"{secs}s"]
    return "".join(p for p in parts if p)


def short(digest: Any, n: int = 12) -> str:
    return str(digest)[:n] if digest else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Left-aligned columns; '-' for None."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)


def fields(pairs: Sequence[tuple[str, Any]]) -> None:
    """`name  value` lines, names aligned; None shows as '-', maps and lists as JSON."""
    width = max((len(k) for k, _ in pairs), default=0)
    for k, v in pairs:
        click.echo(f"{k.ljust(width)}  {_cell(v)}")


@contextlib.contextmanager
def spinner(label: str) -> Iterator[None]:
    """A spinner on stderr while the block runs (the RPC reports no progress); silent when not a terminal."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def spin() -> None:
        for frame in itertools.cycle("|/-\\"):
            click.echo(f"\r{label} {frame} {time.monotonic() - started:.0f}s", nl=False, err=True)
            if done.wait(0.1):
                break
        click.echo("\r" + " " * (len(label) + 12) + "\r", nl=False, err=True)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def error_line(exc: BaseException) -> str:
    """One line for a failure the user should see: `CODE: message` for server errors."""
    from kvwake.errors import KvwakeError

    if isinstance(exc, KvwakeError):
        return f"{exc.code}: {exc.message}"
    return str(exc) or type(exc).__name__


def tool_call_line(call: dict[str, Any]) -> str:
    """A parsed tool call as people read it: `-> name(arguments)  [id]`."""
    f = call.get("function", {})
    return f"-> {f.get('name')}({f.get('arguments')})  [{call.get('id')}]"


def echo_reply(reply: Any) -> None:
    """A whole reply: its content, then one line per tool call; unparsed calls to stderr."""
    if reply.content or not reply.tool_calls:
        click.echo(reply.content)
    for call in reply.tool_calls:
        click.echo(tool_call_line(call))
    _echo_errors(reply)


def echo_stream(stream: Any) -> Any:
    """A streamed reply: content as it comes, each tool call as a line once it parses (its raw
    text is not shown); unparsed calls to stderr at the end. Returns the final `Reply`."""
    line_start = True
    for event in stream.events():
        if "tool_call" in event:
            click.echo(("" if line_start else "\n") + tool_call_line(event["tool_call"]))
            line_start = True
        elif "text" in event and not event.get("tool") and event["text"]:
            click.echo(event["text"], nl=False)
            line_start = event["text"].endswith("\n")
    if not line_start:
        click.echo()
    reply = stream.result
    _echo_errors(reply)
    return reply


def _echo_errors(reply: Any) -> None:
    for error in reply.tool_call_errors:
        click.echo(f"[tool call not parsed, left in the text: {error}]", err=True)
