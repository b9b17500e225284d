"""The `kvwake` command.

Every command but `serve` talks to a running daemon through `kvwake.client`.
Failures print one `Error: ...` line and exit 1: server errors as `CODE:
message`, a missing daemon as "no daemon running at SOCKET" with the hint to
start one. `--json` prints one JSON document for scripts. docs/cli.md is the
reference; every command's docstring is its help, with an example.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from kvwake.client.cli_models import models
from kvwake.client.cli_store import bench, export_, fsck, gc, import_, warm
from kvwake.client.options import Options
from kvwake.client.output import (
    echo_json,
    echo_reply,
    echo_stream,
    error_line,
    fields,
    human_bytes,
    human_duration,
    json_option,
    short,
    table,
)
from kvwake.client.paths import pid_alive, read_status_file
from kvwake.client.demo import demo
from kvwake.client.service import service
from kvwake.client.wire import ClientConnectionError, DaemonNotRunningError
from kvwake.errors import KvwakeError

__all__ = ["main"]


class KvwakeGroup(click.Group):
    """Turns client and server failures into one `Error:` line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DaemonNotRunningError as exc:
            raise click.ClickException(str(exc) + _stale_hint(exc.socket)) from None
        except (KvwakeError, ClientConnectionError, TimeoutError) as exc:
            raise click.ClickException(error_line(exc)) from None


def _stale_hint(socket: str) -> str:
    from pathlib import Path

    info = read_status_file(Path(socket))
    if info and not pid_alive(info.get("pid")):
        return f" (its status file names pid {info.get('pid')}, which is gone)"
    return ""


@click.group(cls=KvwakeGroup)
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="The daemon's socket (env KVWAKE_SOCKET; default in the user runtime dir).")
@click.option("--autostart/--no-autostart", default=None,
              help="Start a daemon in the background if none answers (env KVWAKE_AUTOSTART; default off).")
@click.version_option(package_name="kvwake")
@click.pass_context
def main(ctx: click.Context, socket_path: str | None, autostart: bool | None) -> None:
    """kvwake: an agent memory daemon for MLX.

    Example: kvwake chat -s agent-1 -m "Hello"
    """
    ctx.obj = Options(socket_path, autostart)


def _tune_flags(pairs: Any) -> dict[str, str]:
    """`--tune NAME=VALUE` pairs as {name: value} (a later NAME wins); one without "=" is refused."""
    tuning = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--tune")
        tuning[name.strip()] = value.strip()
    return tuning


@main.command()
@click.option("--socket", "socket_path", type=click.Path(), help="Unix socket to serve (env KVWAKE_SOCKET).")
@click.option("--data-dir", type=click.Path(), help="Store and converted models (env KVWAKE_DATA_DIR).")
@click.option("--model", "model_flags", multiple=True, metavar="[NAME=]PATH",
              help="mlx-lm model folder or hub id (env KVWAKE_MODEL); default SmolLM2-135M-Instruct. Repeatable: "
              "several models by name, the first the default (docs/models.md).")
@click.option("--models-dir", type=click.Path(file_okay=False), help="Serve each model folder in it, by folder name.")
@click.option("--max-loaded", type=click.IntRange(min=1), help="Models loaded at once; the least recently used "
              "one is unloaded (its sessions slept) to load another.")
@click.option("--model-ttl", "model_ttl_s", type=float, help="Seconds a model may go unused before it is unloaded.")
@click.option("--config", "config_file", type=click.Path(), help="TOML config file (env KVWAKE_CONFIG).")
@click.option("--block-tokens", type=int, help="Tokens per stored block (fixed per store).")
@click.option("--hot-budget-bytes", type=int, help="KV bytes of hot sessions before LRU ones sleep "
              "(default: half the memory the KV may have beside the weights).")
@click.option("--idle-timeout", "idle_timeout_s", type=float, help="Seconds idle before a session sleeps.")
@click.option("--max-batch", type=int,
              help="Calls decoded together per forward pass (default 32); 1 decodes each alone, bit-exact.")
@click.option("--max-context", type=int,
              help="Tokens a session may hold (prompt and reply), below the model's own context.")
@click.option("--persist/--no-persist", default=None,
              help="Write hot sessions' full blocks as they fill, so kill -9 loses at most the tail (default on).")
@click.option("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--remote", help="Shared tier s3://BUCKET/PREFIX (env KVWAKE_REMOTE).")
@click.option("--remote-endpoint", help="S3 endpoint URL (env AWS_ENDPOINT_URL); credentials: AWS_ACCESS_KEY_ID, "
              "AWS_SECRET_ACCESS_KEY.")
@click.option("--http", help="Serve the OpenAI-compatible API on [HOST:]PORT (a bare port binds 127.0.0.1).")
@click.option("--http-token", help="Its bearer token (env KVWAKE_HTTP_TOKEN; default: made once in "
              "<data dir>/http-token; `kvwake http` shows it).")
@click.option("--http-no-token", "http_no_token", is_flag=True,
              help="Ask no bearer token (loopback only): any local user could read every session.")
@click.option("--http-hosted-tools", type=click.Choice(["omit", "refuse"]),
              help="OpenAI's built-in tools (web_search, ...) in a Responses request: left out of the prompt "
              "and named in the X-Kvwake-Omitted-Tools header (omit, the default), or refused by name.")
@click.option("--tune", "tune", multiple=True, metavar="NAME=VALUE",
              help="A tuning knob (repeatable; env KVWAKE_<NAME>, config [tuning]); docs/service.md lists them.")
@click.pass_obj
def serve(opts: Options, **flags: object) -> None:
    """Run the daemon in the foreground.

    Example: kvwake serve --model ~/models/Qwen3-4B-4bit --tune slice_of_step=2
    """
    import dataclasses
    import logging
    import os
    from pathlib import Path

    # Settings and activation import nothing heavy: they come before lighten_imports, which they tune
    from kvwake.daemon.activation import ActivationError, listen_socket_from_env, socket_path
    from kvwake.daemon.config import load_settings

    config = flags.pop("config_file")
    flags["http_auth"] = False if flags.pop("http_no_token") else None
    flags["socket"] = flags.pop("socket_path") or (opts.socket if opts else None)
    flags["tuning"] = _tune_flags(flags.pop("tune"))
    given = flags.pop("model_flags")
    flags["model"], flags["more_models"] = (given[0], given[1:] or None) if given else (None, None)
    try:
        settings = load_settings(flags, Path(str(config)) if config else None)
        listen = listen_socket_from_env()  # systemd socket activation: LISTEN_FDS / LISTEN_PID
    except (ValueError, ActivationError) as exc:
        raise click.ClickException(str(exc)) from None
    from kvwake.daemon.imports import lighten_imports

    lighten_imports(settings.tuning.import_frameworks)  # before anything imports transformers
    from kvwake.daemon.kv.bundle import start_digests_early

    start_digests_early(settings.model, settings.data_dir)  # the bundle's file reads overlap the imports and the load
    from kvwake.daemon.model.kernel_cache import start_early

    # CUDA: the kernels' compiles overlap them too
    start_early(settings.model, settings.tuning.kernel_warmer, settings.tuning.paged_kv, settings.tuning.paths_ahead)
    from kvwake.daemon.serve import run

    if listen is not None and socket_path(listen) is not None:  # the status file goes next to the socket served
        settings = dataclasses.replace(settings, socket=socket_path(listen))
    code = run(settings, listen_socket=listen)
    # Every session slept, the store and the lock are closed: leave without the interpreter's teardown,
    # where MLX's per-thread state of threads other than the engine's may be destroyed after CUDA's and
    # crash the exit (SIGSEGV after "stopped": docs/decisions.md, "Leaving the process after a stop").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@main.command()
@json_option
@click.pass_obj
def status(opts: Options, as_json: bool) -> None:
    """Show the daemon: pid, model, sessions, memory, store.

    Example: kvwake status --json
    """
    with opts.client() as client:
        hello, state = client.hello("kvwake-cli"), client.status()
    info = read_status_file(client.socket) or {}
    data = {"socket": str(client.socket), "version": hello.get("version"), "protocol": hello.get("protocol"),
            "started": info.get("started"), **state}
    if as_json:
        return echo_json(data)
    up = f", up {human_duration(time.time() - data['started'])}" if isinstance(data["started"], (int, float)) else ""
    mem, sessions, store = state.get("memory", {}), state.get("sessions", {}), state.get("store", {})
    counters = ", ".join(f"{k} {v}" for k, v in state.get("counters", {}).items())
    fields([
        ("daemon", f"running, pid {state.get('pid')}, version {data['version']}{up}"),
        ("socket", data["socket"]),
        ("model", f"{state.get('model')} (bundle {short(state.get('bundle_hash'))})"),
        *([("models", _models_line(state["models"]))] if len(state.get("models") or []) > 1 else []),
        ("sessions", f"{sessions.get('hot', 0)} hot, {sessions.get('asleep', 0)} asleep"),
        ("memory", f"hot KV {human_bytes(mem.get('hot_kv_bytes'))} of {human_bytes(mem.get('hot_budget_bytes'))}, "
                   f"RAM tier {human_bytes(mem.get('ram_tier_bytes'))}, "
                   f"peak RSS {human_bytes(mem.get('peak_rss_bytes'))}"),
        ("store", f"{human_bytes(store.get('stored_bytes'))} in {store.get('path')}"
                  + (f", {store['points']} restore points ({human_bytes(store.get('point_bytes'))}, "
                     f"{100 * store.get('point_share', 0):.1f}%)"
                     if store.get("points") else "")),
        ("persistence", _persistence(state.get("persistence") or {})),
        ("codec", _codec_line(store)),
        ("counters", counters or "-"),
    ])


def _models_line(models: list[dict]) -> str:
    """Every model served: its name, state and sessions (hot/asleep)."""
    return ", ".join(f"{m['name']} {m['state']} ({m['sessions']['hot']} hot, {m['sessions']['asleep']} asleep)"
                     for m in models)


def _persistence(p: dict) -> str:
    """The status line of continuous persistence: on or off (and why), what it wrote."""
    if not p.get("enabled"):
        return str(p.get("state", "-"))
    return (f"on: {p.get('checkpoints', 0)} checkpoints, {p.get('checkpoint_blocks', 0)} blocks, "
            f"{human_bytes(p.get('checkpoint_bytes'))} written, {p.get('queued', 0)} queued")


def _codec_line(store: dict) -> str:
    """The codec new blocks get, and why: set in the config, or measured here (codec = "auto")."""
    choice = store.get("codec_choice")
    if not choice:
        return f"{store.get('codec', '?')} (set in the config)"
    return f"{store.get('codec')} (auto: {choice.get('why')}, measured on {choice.get('on')})"


@main.command("http")
@click.option("--env", "as_env", is_flag=True,
              help="Print shell exports: OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY.")
@json_option
@click.pass_obj
def http_command(opts: Options, as_env: bool, as_json: bool) -> None:
    """Show the daemon's OpenAI- and Anthropic-compatible API: its base URL and token.

    Example: eval "$(kvwake http --env)"; claude   # or any OpenAI or Anthropic client library
    """
    from kvwake.client.paths import openai_config, resolve_socket

    try:
        config = openai_config(opts.socket if opts else None)
    except (LookupError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        return echo_json(config)
    if as_env:
        key = shlex.quote(config["api_key"])
        click.echo(f"export OPENAI_BASE_URL={shlex.quote(config['base_url'])}\nexport OPENAI_API_KEY={key}\n"
                   f"export ANTHROPIC_BASE_URL={shlex.quote(config['base_url'].removesuffix('/v1'))}\n"
                   f"export ANTHROPIC_API_KEY={key}")
        served = (read_status_file(resolve_socket(opts.socket if opts else None)) or {}).get("models") or []
        if len(served) > 1:  # Claude Code's main and small model: the default, and the second served
            main, small = shlex.quote(served[0]), shlex.quote(served[1])
            click.echo(f"export ANTHROPIC_MODEL={main}\nexport ANTHROPIC_DEFAULT_SONNET_MODEL={main}\n"
                       f"export ANTHROPIC_DEFAULT_OPUS_MODEL={main}\nexport ANTHROPIC_SMALL_FAST_MODEL={small}\n"
                       f"export ANTHROPIC_DEFAULT_HAIKU_MODEL={small}")
        return
    fields([("base url", config["base_url"]), ("api key", config["api_key"]),
            ("socket", str(resolve_socket(opts.socket if opts else None)))])


def generate_options(fn: Any) -> Any:
    """Sampling options shared by `chat` (None: the daemon's default)."""
    for option in reversed([
        click.option("--max-tokens", type=int, default=None, help="Most tokens per reply (daemon default 256)."),
        click.option("--temperature", type=float, default=None, help="0 is greedy (the default)."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling (0 disables)."),
        click.option("--top-k", type=int, default=None, help="Top-k sampling (0 disables)."),
        click.option("--seed", type=int, default=None, help="Seed for repeatable sampling."),
        click.option("--stop", multiple=True, help="A stop string (repeatable)."),
    ]):
        fn = option(fn)
    return fn


@main.command()
@click.option("-s", "--session", "session_id", help="Session id; created if new (default: a new session).")
@click.option("-m", "--message", help="One-shot: send this message, print the reply, exit ('-' reads stdin).")
@click.option("--system", help="System prompt, if the session is created now.")
@generate_options
@click.option("--stream/--no-stream", default=True, help="Print the reply as it is generated (default on).")
@json_option
@click.pass_obj
def chat(opts: Options, session_id: str | None, message: str | None, system: str | None, stream: bool,
         as_json: bool, **gen: Any) -> None:
    """Chat with a session: interactive, or one message with -m.

    Interactive commands: /sleep, /wake, /fork, /checkpoint LABEL, /info, /help, /quit.
    One-shot, the new session's id goes to stderr (and into --json output).

    Example: kvwake chat -s agent-1 -m "Summarize our plan" --max-tokens 200
    """
    gen = {k: v for k, v in gen.items() if v is not None and v != ()}
    if as_json and message is None:
        raise click.UsageError("--json needs a one-shot message (-m)")
    with opts.client() as client:
        session = client.session(session_id, system=system)
        if message is None:
            from kvwake.client.repl import Repl

            state = "new" if session.created else "existing"
            click.echo(f"[{state} session {session.id}; /help lists commands, /quit leaves]", err=True)
            return Repl(client, session.id, gen, stream=stream).run()
        if message == "-":
            message = sys.stdin.read()
        if session_id is None and not as_json:
            click.echo(f"session: {session.id}", err=True)
        if as_json:
            return echo_json({"session_id": session.id, **client.chat(session.id, message, **gen).to_dict()})
        if not stream:
            return echo_reply(client.chat(session.id, message, **gen))
        with client.chat(session.id, message, stream=True, **gen) as replying:
            echo_stream(replying)


# -- sessions -------------------------------------------------------------


LIST_PAGE = 1000  # sessions asked per page when listing with a filter


def _list_sessions(opts: Options, as_json: bool, origin: str | None = None, state: str | None = None,
                   limit: int | None = None) -> None:
    with opts.client() as client:
        if origin is None and state is None and limit is None:
            sessions = client.list_sessions()  # everything, remote sessions too
        else:  # a page at a time, so a daemon of many sessions answers each in bounded time
            sessions, after = [], None
            while limit is None or len(sessions) < limit:
                want = LIST_PAGE if limit is None else min(LIST_PAGE, limit - len(sessions))
                page = client.session_page(limit=want, after=after, origin=origin, state=state)
                sessions += page["sessions"]
                if (after := page["next"]) is None:
                    break
    if as_json:
        return echo_json(sessions)
    table(["SESSION", "MODEL", "STATE", "TOKENS", "BUSY"],
          [[s["session_id"], s.get("model"), s["state"], s.get("tokens"), s.get("busy")] for s in sessions])


def list_options(f: Callable) -> Callable:
    """--origin, --state and --limit of `kvwake sessions` and `kvwake sessions list`."""
    f = click.option("--limit", type=click.IntRange(min=1), help="List at most this many (in id order).")(f)
    f = click.option("--state", type=click.Choice(["hot", "asleep"]), help="Only hot, or only asleep, sessions.")(f)
    return click.option("--origin", help='Only sessions whose metadata origin is this ("http": stateless ones).')(f)


@main.group(invoke_without_command=True)
@json_option
@list_options
@click.pass_context
def sessions(ctx: click.Context, as_json: bool, origin: str | None, state: str | None, limit: int | None) -> None:
    """List sessions (the default), or show, create or remove one.

    With --origin, --state or --limit the daemon answers a page at a time (this daemon's sessions only).

    Example: kvwake sessions --origin http --state asleep --limit 20
    """
    if ctx.invoked_subcommand is None:
        _list_sessions(ctx.obj, as_json, origin, state, limit)


@sessions.command("list")
@json_option
@list_options
@click.pass_obj
def sessions_list(opts: Options, as_json: bool, origin: str | None, state: str | None, limit: int | None) -> None:
    """List sessions: id, hot or asleep, tokens, what it is busy with (filtered: a page at a time).

    Example: kvwake sessions list --origin http
    """
    _list_sessions(opts, as_json, origin, state, limit)


@sessions.command("show")
@click.argument("session_id")
@json_option
@click.pass_obj
def sessions_show(opts: Options, session_id: str, as_json: bool) -> None:
    """Show one session and its snapshots.

    Example: kvwake sessions show agent-1
    """
    with opts.client() as client:
        info = client.session_info(session_id)
        snaps = client.list_snapshots(session_id)
    if as_json:
        return echo_json({**info, "snapshot_list": snaps})
    fields([(k, v) for k, v in info.items()])
    if snaps:
        click.echo()
        _snapshot_table(snaps)


@sessions.command("new")
@click.argument("session_id", required=False)
@click.option("--system", help="System prompt.")
@click.option("--model", help="The model it runs on, for good (a name the daemon serves; default: its first).")
@click.option("--metadata", help="Metadata as a JSON object.")
@json_option
@click.pass_obj
def sessions_new(opts: Options, session_id: str | None, system: str | None, model: str | None,
                 metadata: str | None, as_json: bool) -> None:
    """Create a session (a new id is made up if none is given); prints its id.

    Example: kvwake sessions new agent-1 --system "You are terse." --metadata '{"team": "ops"}'
    """
    meta = None
    if metadata is not None:
        try:
            meta = json.loads(metadata)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--metadata") from None
    with opts.client() as client:
        result = client.create_session(session_id, system=system, metadata=meta, model=model)
    echo_json(result) if as_json else click.echo(result["session_id"])


@sessions.command("rm")
@click.argument("session_ids", nargs=-1, required=True)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_obj
def sessions_rm(opts: Options, session_ids: tuple[str, ...], yes: bool, as_json: bool) -> None:
    """Delete sessions and all their snapshots (checkpoints too).

    Example: kvwake sessions rm agent-1 agent-2 --yes
    """
    if not yes:
        click.confirm(f"Delete {', '.join(session_ids)} and all their snapshots?", abort=True)
    with opts.client() as client:
        results = [client.delete_session(sid) for sid in session_ids]
    if as_json:
        return echo_json(results)
    for r in results:
        click.echo(f"deleted {r['session_id']} ({r['snapshots_removed']} snapshots)")


# -- one session --------------------------------------------------------------


@main.command()
@click.argument("session_id")
@json_option
@click.pass_obj
def sleep(opts: Options, session_id: str, as_json: bool) -> None:
    """Write a session's KV to disk and free its memory.

    Example: kvwake sleep agent-1
    """
    with opts.client() as client:
        r = client.sleep(session_id)
    if as_json:
        return echo_json(r)
    if r.get("already_asleep"):
        return click.echo(f"{session_id} was already asleep (snapshot {r.get('snapshot_id')})")
    click.echo(f"{session_id} asleep: snapshot {r['snapshot_id']}, {r['tokens']} tokens, "
               f"{human_bytes(r.get('stored_bytes'))} stored ({human_bytes(r.get('written_bytes'))} new), "
               f"{r.get('new_blocks')} new / {r.get('reused_blocks')} reused blocks, {r['ms']:.0f} ms")


@main.command()
@click.argument("session_id")
@click.option("--snapshot", "snapshot_id", help="Restore this snapshot instead of the latest.")
@json_option
@click.pass_obj
def wake(opts: Options, session_id: str, snapshot_id: str | None, as_json: bool) -> None:
    """Restore a sleeping session's KV exactly (any chat wakes it too).

    Example: kvwake wake agent-1 --snapshot 1a1fdf2f2111c5e01f2e1
    """
    with opts.client() as client:
        r = client.wake(session_id, snapshot_id)
    if as_json:
        return echo_json(r)
    if r.get("already_awake"):
        return click.echo(f"{session_id} was already awake ({r.get('tokens')} tokens)")
    click.echo(f"{session_id} awake: {r['tokens']} tokens from snapshot {r['snapshot_id']} "
               f"({r.get('blocks_from_memory')} blocks from memory, {r.get('blocks_from_disk')} from disk), "
               f"{r['ms']:.0f} ms")


@main.command()
@click.argument("session_id")
@click.argument("new_session_id", required=False)
@click.option("--snapshot", "snapshot_id", help="Fork from this snapshot instead of the session as it is now.")
@json_option
@click.pass_obj
def fork(opts: Options, session_id: str, new_session_id: str | None, snapshot_id: str | None,
         as_json: bool) -> None:
    """Branch a session into a new one that starts where it is (blocks are shared, not copied).

    Example: kvwake fork agent-1 agent-1-retry
    """
    with opts.client() as client:
        r = client.fork(session_id, new_session_id, snapshot_id=snapshot_id)
    echo_json(r) if as_json else click.echo(f"forked {session_id} into {r['session_id']} "
                                            f"(snapshot {r['snapshot_id']})")


@main.command()
@click.argument("session_id")
@click.argument("label")
@json_option
@click.pass_obj
def checkpoint(opts: Options, session_id: str, label: str, as_json: bool) -> None:
    """Save a labeled snapshot of a session now (gc keeps it; the session stays hot).

    Example: kvwake checkpoint agent-1 before-refactor
    """
    with opts.client() as client:
        r = client.checkpoint(session_id, label)
    echo_json(r) if as_json else click.echo(f"checkpoint {r['label']!r} of {session_id}: snapshot {r['snapshot_id']}")


def _snapshot_table(snaps: list[dict[str, Any]]) -> None:
    table(["SNAPSHOT", "SESSION", "TOKENS", "BLOCKS", "LABEL", "CREATED"],
          [[s.get("id"), s.get("session_id"), s.get("n_tokens"), s.get("n_blocks"), s.get("label"),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["created"])) if s.get("created") else None]
           for s in snaps])


@main.command()
@click.argument("session_id", required=False)
@json_option
@click.pass_obj
def snapshots(opts: Options, session_id: str | None, as_json: bool) -> None:
    """List snapshots, oldest first, of one session or of all.

    Example: kvwake snapshots agent-1
    """
    with opts.client() as client:
        snaps = client.list_snapshots(session_id)
    echo_json(snaps) if as_json else _snapshot_table(snaps)


# -- the daemon -------------------------------------------------------------------


@main.command()
@json_option
@click.pass_obj
def stop(opts: Options, as_json: bool) -> None:
    """Stop the daemon; it sleeps every hot session first.

    Example: kvwake stop
    """
    with opts.client() as client:
        r = client.shutdown()
    echo_json(r) if as_json else click.echo(f"daemon at {client.socket} is stopping")


for command in (export_, import_, gc, fsck, warm, bench):
    main.add_command(command)
# `kvwake service install|uninstall|status` lives in client/service.py (docs/service.md).
main.add_command(service)
main.add_command(models)
main.add_command(demo)


if __name__ == "__main__":
    main()
