"""`kvwake export`, `import`, `gc`, `fsck`, `warm` and `bench`: the store and the daemon as a whole.

Registered on the `kvwake` group by client/cli.py, which also turns their
failures into one `Error:` line. `opts` is client/options.py's Options (the
global --socket and --autostart).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import click

from kvwake.client.options import Options
from kvwake.client.output import echo_json, fields, human_bytes, json_option, short, spinner

__all__ = ["bench", "export_", "fsck", "gc", "import_", "warm"]


@click.command("export")
@click.argument("snapshot_id")
@click.argument("path", type=click.Path(dir_okay=False))
@json_option
@click.pass_obj
def export_(opts: Options, snapshot_id: str, path: str, as_json: bool) -> None:
    """Write a snapshot to a portable file (the daemon writes it; the file must not exist).

    Example: kvwake export 1a1fdf2f2111c5e01f2e1 ~/agent-1.kvwake
    """
    with opts.client() as client, spinner("exporting"):
        r = client.export_snapshot(snapshot_id, path)
    echo_json(r) if as_json else fields([(k, v) for k, v in r.items()])


@click.command("import")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("-s", "--session", "session_id", help="Import as this session (default: the one it was taken from).")
@json_option
@click.pass_obj
def import_(opts: Options, path: str, session_id: str | None, as_json: bool) -> None:
    """Import a portable snapshot file; its session appears asleep.

    Example: kvwake import ~/agent-1.kvwake --session agent-1-copy
    """
    with opts.client() as client, spinner("importing"):
        r = client.import_snapshot(path, session_id=session_id)
    echo_json(r) if as_json else fields([(k, v) for k, v in r.items()])


@click.command()
@click.option("--remote", is_flag=True, help="Collect the shared tier (serve --remote) instead of the local store.")
@click.option("--grace", "grace_s", type=click.FloatRange(0),
              help="With --remote: keep unreferenced objects younger than this many seconds (default 3600).")
@click.option("--verify", is_flag=True, help="With --remote: also read every referenced object; remove damaged ones.")
@json_option
@click.pass_obj
def gc(opts: Options, remote: bool, grace_s: float | None, verify: bool, as_json: bool) -> None:
    """Prune old unlabeled snapshots, evict prefix blocks over budget, sweep orphan files.

    With --remote: remove the shared tier's objects that no manifest names (never one a manifest names).

    Example: kvwake gc --remote --grace 86400 --verify
    """
    if not remote and (verify or grace_s is not None):
        raise click.UsageError("--grace and --verify go with --remote")
    with opts.client() as client, spinner("collecting"):
        r = client.gc(remote=True, grace_s=grace_s, verify=verify) if remote else client.gc()
        r = r.get("remote", r)
    echo_json(r) if as_json else fields([(k, v) for k, v in r.items()])


@click.command()
@json_option
@click.pass_obj
def fsck(opts: Options, as_json: bool) -> None:
    """Verify every stored block and snapshot; exits 1 if anything is damaged.

    Example: kvwake fsck --json
    """
    with opts.client() as client, spinner("checking"):
        r = client.fsck()
    if as_json:
        echo_json(r)
    else:
        fields([(k, v) for k, v in r.items()])
    if not r.get("ok", False):
        sys.exit(1)


@click.command()
@click.option("--text", help="The shared prompt as raw text.")
@click.option("--system", help="The shared prompt as a system message (as sessions created with --system start).")
@click.option("--file", "file", type=click.File("r"), help="Read the shared prompt text from a file ('-': stdin).")
@json_option
@click.pass_obj
def warm(opts: Options, text: str | None, system: str | None, file: Any, as_json: bool) -> None:
    """Prefill a shared prompt once and pin its blocks, so new sessions reuse them.

    Example: kvwake warm --system "$(cat tool-manual.txt)"
    """
    given = [x for x in (text, system, file) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --text, --system, --file")
    with opts.client() as client, spinner("warming"):
        if system is not None:
            r = client.warm_prefix([{"role": "system", "content": system}])
        else:
            r = client.warm_prefix(text=text if text is not None else file.read())
    echo_json(r) if as_json else fields([(k, v) for k, v in r.items()])


@click.command(context_settings={"allow_interspersed_args": False})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--list", "list_", is_flag=True, help="List the registered benchmarks NAME can be.")
@click.option("--sessions", "n_sessions", type=click.IntRange(1), default=4, show_default=True,
              help="Sessions to run, one after another.")
@click.option("--cycles", type=click.IntRange(0), default=2, show_default=True,
              help="Sleep/wake/chat rounds per session.")
@click.option("--system-words", type=click.IntRange(1), default=200, show_default=True,
              help="Words in the shared system prompt.")
@click.option("--max-tokens", type=click.IntRange(1), default=16, show_default=True, help="Tokens per reply.")
@click.option("--keep", is_flag=True, help="Keep the benchmark's sessions (default: delete them).")
@json_option
@click.pass_context
def bench(ctx: click.Context, name: str | None, args: tuple[str, ...], list_: bool, n_sessions: int, cycles: int,
          system_words: int, max_tokens: int, keep: bool, as_json: bool) -> None:
    """Measure sleep, wake, prefix reuse and time to first token on the running daemon.

    With NAME, run that registered benchmark instead, with ARGS (its own options: `kvwake bench NAME --help`);
    each starts its own daemons. They are bench/'s scripts, found beside the package in a repository
    checkout (pip install -e .); `--list` names them.

    Example: kvwake bench --sessions 8 --cycles 3 --json > bench.json

    Example: kvwake bench batching --model tiny --sessions 1,8
    """
    if list_:
        return _list_workloads(as_json)
    if name is not None:
        own = [p.opts[0] for p in ctx.command.params if p.name not in ("name", "args") and
               ctx.get_parameter_source(p.name) is not click.core.ParameterSource.DEFAULT]
        if own:
            raise click.UsageError(f"{own[0]} is the built-in benchmark's option; a named "
                                   f"one takes its own after NAME (kvwake bench {name} --help)")
        return _run_workload(name, args)
    _bench_loop(ctx.obj, n_sessions, cycles, system_words, max_tokens, keep, as_json)


def _list_workloads(as_json: bool) -> None:
    from kvwake.client.bench import WORKLOADS

    if as_json:
        return echo_json([{"name": w.name, "script": f"bench/{w.script}", "args": list(w.args), "about": w.about}
                          for w in WORKLOADS])
    fields([(w.name, w.about) for w in WORKLOADS])


def _run_workload(name: str, args: tuple[str, ...]) -> None:
    from kvwake.client.bench import NoBenchDir, UnknownBenchmark, bench_dir, workload_argv

    try:
        argv = workload_argv(name, args)
    except (NoBenchDir, UnknownBenchmark) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(subprocess.run(argv, cwd=bench_dir().parent).returncode)


def _bench_loop(opts: Options, n_sessions: int, cycles: int, system_words: int, max_tokens: int, keep: bool,
                as_json: bool) -> None:
    from kvwake.client.bench import BenchConfig, run_bench
    from kvwake.client.codecs import codec_advice

    config = BenchConfig(n_sessions, cycles, system_words, max_tokens, keep)
    with opts.client() as client:
        with click.progressbar(length=n_sessions, label="benchmark", file=sys.stderr) as bar:
            report = run_bench(client, config, bar.update)
        store = client.status()["store"]
        report["codecs"] = codec_advice(store["path"], among=store.get("auto_among"))
    if as_json:
        return echo_json(report)
    s = report["summary"]
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    click.echo(f"model {report['model']} (bundle {short(report['bundle_hash'])}), {n_sessions} sessions, "
               f"{cycles} cycles, {system_words}-word shared system prompt")
    fields([
        ("cold first-turn ttft", ms(s["cold_ttft_ms"])),
        ("first-turn ttft p50", ms(s["first_turn_ttft_ms_p50"])),
        ("shared-prefix reuse", "-" if s["prefix_reuse_rate"] is None else f"{s['prefix_reuse_rate']:.1%}"),
        ("sleep p50 / max", f"{ms(s['sleep_ms_p50'])} / {ms(s['sleep_ms_max'])}"),
        ("wake p50 / max", f"{ms(s['wake_ms_p50'])} / {ms(s['wake_ms_max'])}"),
        ("ttft after wake p50", ms(s["ttft_after_wake_ms_p50"])),
        ("decode p50", "-" if s["tokens_per_s_p50"] is None else f"{s['tokens_per_s_p50']:.0f} tokens/s"),
        ("snapshot tokens p50", s["snapshot_tokens_p50"]),
        ("compression", "-" if s["compression_ratio"] is None else f"{s['compression_ratio']:.2f}x"),
        ("bytes written", human_bytes(s["written_bytes"])),
    ])
    c = report["codecs"]
    for name, r in c.get("codecs", {}).items():
        click.echo(f"codec {name}: {r['ratio']:.2f}x, decode {r['decode_GBps_1core']:.2f} GB/s/core, disk read "
                   f"{r['disk_read_GBps']:.2f} GB/s, wake ~{r['wake_GBps_estimate']:.2f} GB/s, "
                   f"sleep ~{r['sleep_GBps_estimate']:.2f} GB/s")
    click.echo(f"recommended codec: {c['recommended']} ({c['why']})" if c.get("recommended")
               else f"codec: no advice ({c.get('why')})")
