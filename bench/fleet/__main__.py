"""A fleet of agents on kvwake against mlx_lm.server, every phase (issue 50).

usage: python bench/fleet [--model tiny|PATH] [--agents 4] [--system-tokens 2048] [--turns 3] [--task-tokens 444]
                          [--result-tokens 270] [--reply-tokens 128] [--tools 2] [--apis openai,anthropic]
                          [--variants bf16] [--targets auto|gpu|here] [--out bench/out/fleet]

N agents share a system prompt and tool schemas; each has its own task. Round 1 sends every agent's task at
once; each later round sends every agent's next turn at once: its whole conversation, with its last reply
as an assistant message calling a tool and that tool's result (--result-tokens). Replies are greedy, at
most --reply-tokens, streamed. After --turns rounds the server is restarted (kvwake: SIGTERM, every session
sleeps) and one more round is sent. Each server is a fresh process on a fresh store:
  mlx_lm.server   the installed mlx-lm's server, its defaults, over the `openai` package
  kvwake openai   `kvwake serve --http` over the `openai` package (chat completions)
  kvwake anthropic  the same daemon's Anthropic Messages API over the `anthropic` package
Variants: bf16 (the model as given) and q4 (`mlx_lm convert -q` of it, made once per run). --agents and
--system-tokens take lists (1,8,16): every pair is run. Per run: start time (process start to its first
answered request), first token p50/p95 of each round (client-side: sent to the first streamed token), each
round's wall time, aggregate tokens/s (the rounds before the restart), first token after the restart,
peak RSS of the server (and MLX's peak from kvwake's status). Then kvwake / mlx_lm.server per phase beside
issue 50's targets (bench/fleet/report.py). Results: <out>/fleet.json and <out>/fleet.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Run as a script, Python puts this folder first on sys.path; the repository root (testkit/, bench/) takes its
# place, so this package's modules are reached only as bench.fleet.*, never as top-level names.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != HERE)]

from bench.fleet.agents import Fleet, Texts  # noqa: E402
from bench.fleet.report import compare, summary, table  # noqa: E402
from bench.fleet.run import run_server  # noqa: E402
from bench.fleet.servers import Kvwake, MlxServer  # noqa: E402
from bench.lib import agent_model, machine  # noqa: E402


def quantized(model: Path, work: Path) -> Path:
    """`mlx_lm convert -q` of `model` (4-bit weights), into `work`."""
    out = work / f"{model.name}-q4"
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)  # a conversion cut short: mlx_lm convert refuses an existing folder
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(model), "--mlx-path", str(out),
                        "-q"], check=True, capture_output=True)
    return out


def one_config(model: Path, fleet: Fleet, apis: list[str], work: Path, gpu: bool, baseline: bool = True) -> dict[str, Any]:
    """Every server of one configuration, mlx_lm.server first (unless `baseline` is off: kvwake's own figures,
    nothing compared); the comparisons per kvwake API. A baseline whose turns failed is reported as failed
    (`failed`: why), and kvwake's runs go on, their figures beside no ratio."""
    texts = Texts(model)
    system = texts.system(fleet)
    runs: dict[str, Any] = {}
    if baseline:
        try:
            runs["mlx_lm.server"] = summary(run_server(MlxServer(work / "mlx", model), "openai", fleet, texts, system))
        except Exception as exc:  # noqa: BLE001 - the baseline's failure (its turns, its start) is its result
            print(f"mlx_lm.server failed: {exc!r}", flush=True)
            runs["mlx_lm.server"] = {"server": "mlx_lm.server", "failed": repr(exc)}
    for api in apis:
        runs[f"kvwake {api}"] = summary(run_server(Kvwake(work / f"kvwake-{api}", model), api, fleet, texts, system))
    return {"fleet": asdict(fleet), "runs": runs,
            "compared": {name: compare(run, runs["mlx_lm.server"], gpu) for name, run in runs.items()
                         if name != "mlx_lm.server" and baseline}}


def options() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (the test kit's, 64k context, tools template) or a folder")
    ap.add_argument("--agents", default="4", help="agents, or a list: 1,8,16")
    ap.add_argument("--system-tokens", default="2048", help="the shared system prompt, or a list: 1024,10240")
    ap.add_argument("--turns", type=int, default=3, help="rounds before the restart")
    ap.add_argument("--task-tokens", type=int, default=444)
    ap.add_argument("--result-tokens", type=int, default=270)
    ap.add_argument("--reply-tokens", type=int, default=128)
    ap.add_argument("--tools", type=int, default=2, help="tool schemas (~485 tokens each on the tiny model)")
    ap.add_argument("--apis", default="openai,anthropic", help="kvwake's APIs to run: openai, anthropic")
    ap.add_argument("--variants", default="bf16", help="bf16 (the model as given), q4 (its 4-bit conversion): bf16,q4")
    ap.add_argument("--q4-dir", default=None,
                    help="where the q4 conversion is kept (MODEL-q4 there is taken as it is if present; default: this "
                         "run's temporary folder)")
    ap.add_argument("--targets", default="auto", choices=("auto", "gpu", "here"),
                    help="the GPU machine's targets or the looser ones (auto: gpu when MLX runs on one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "fleet"))
    ap.add_argument("--no-baseline", action="store_true",
                    help="kvwake alone, mlx_lm.server not run (nothing compared: a probe of kvwake's own phases)")
    a = ap.parse_args()
    if not set(a.variants.split(",")) <= {"bf16", "q4"}:
        ap.error(f"--variants: bf16 or q4, not {a.variants!r}")
    return a


def main() -> None:
    a = options()
    work = Path(tempfile.mkdtemp(prefix="kvwake-fleet-"))
    given = agent_model(a.model, work)
    where = machine()
    gpu = a.targets == "gpu" or (a.targets == "auto" and "gpu" in where["mlx_device"])
    base = Fleet(turns=a.turns, task_tokens=a.task_tokens, result_tokens=a.result_tokens,
                 reply_tokens=a.reply_tokens, tools=a.tools)
    configs, text = [], []
    for variant in a.variants.split(","):
        model = given if variant == "bf16" else quantized(given, Path(a.q4_dir) if a.q4_dir else work)
        for agents in map(int, a.agents.split(",")):
            for system_tokens in map(int, a.system_tokens.split(",")):
                fleet = replace(base, agents=agents, system_tokens=system_tokens)
                print(f"== {variant}: {agents} agents, {system_tokens}-token system prompt", flush=True)
                done = one_config(model, fleet, a.apis.split(","), work / f"{variant}-{agents}-{system_tokens}", gpu,
                                  baseline=not a.no_baseline)
                configs.append({"variant": variant, **done})
                failed = done["runs"].get("mlx_lm.server", {}).get("failed")
                for name, rows in done["compared"].items():
                    text.append(table(rows, f"{variant}, {agents} agents, {system_tokens}-token prompt, "
                                            f"{a.turns} turns: {name} against mlx_lm.server"
                                            + (f" (mlx_lm.server failed: {failed})" if failed else "")))
                    print(text[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": where, "model": a.model, "targets": "gpu" if gpu else "here", "configs": configs}
    (out / "fleet.json").write_text(json.dumps(report, indent=1))
    for trace in work.glob("**/trace-*.json"):  # kvwake's status per process (servers.py): where turns went
        (out / "traces").mkdir(exist_ok=True)
        shutil.copy(trace, out / "traces" / f"{trace.parent.parent.name}-{trace.parent.name}-{trace.name}")
    for log in work.glob("**/daemon.log"):  # kvwake's own log (its warmers, slow jobs), its last 64 KB
        (out / "traces").mkdir(exist_ok=True)
        (out / "traces" / f"{log.parent.parent.name}-{log.parent.name}-daemon.log").write_bytes(log.read_bytes()[-65536:])
    (out / "fleet.md").write_text("\n\n".join(text) + "\n")
    print(f"results: {out / 'fleet.json'}, {out / 'fleet.md'}")


if __name__ == "__main__":
    main()
