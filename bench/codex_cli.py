"""The real Codex CLI against kvwake: `codex exec`, then `codex exec resume --last`, then, after a daemon
restart, `resume --last` again.

usage: python bench/codex_cli.py [--version 0.171.0] [--hosted omit|disabled] [--call exec|namespace]
                                 [--out bench/out/cpu]

Installs `@openai/codex` from npm once (into ~/.cache/kvwake-bench/codex), starts `kvwake serve
--http` on a scripted tiny model (testkit/tinymodel.py: 1 byte = 1 token, a 128k context) and points
Codex at it with a provider in CODEX_HOME/config.toml (`wire_api = "responses"`, the token from
`kvwake http` in KVWAKE_KEY), as docs/http.md says. The model's reply depends on how its prompt
ends (tinymodel.after_tool_template): after the user's words it calls a Codex tool (`--call exec`:
`exec_command` with `echo`; `--call namespace`: `multi_agent_v1`'s `close_agent`, a member of
Codex's namespace tool, on an agent that does not exist), and after the tool's output (the template opens that assistant turn
with a tab) it answers in words. So every `codex exec` turn is two requests: the call, Codex runs
the tool and sends its output back, the answer.

`--hosted omit` (the default) leaves Codex's config as it is (its web_search tool and all) and the
daemon's too (it leaves OpenAI's built-in tools out of the prompt: `http_hosted_tools = "omit"`);
`--hosted disabled` turns Codex's web_search tool off in its config (`web_search = "disabled"`) and
starts the daemon with `--http-hosted-tools refuse`, so a built-in tool Codex still sent would fail the
turn. Codex runs with `--dangerously-bypass-approvals-and-sandbox` (its
bubblewrap sandbox needs user namespaces; the one command is an echo, in a temporary folder).
Per turn: what Codex printed (`--json` events: the tool run, its output, the answer), its own usage
(input and cached input tokens, summed over the turn's requests; Codex adds them up over the
thread, `turn_usage` is the turn's own) and the wall time.
Results: <out>/codex_cli_<call>_<hosted>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import npm_binary  # noqa: E402
from kvwake.client import openai_config  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402
from testkit.tinymodel import after_tool_template, make_scripted_model  # noqa: E402

VERSION = "0.171.0"  # the current release on npm, tried (docs/http.md)
CALLS = {"exec": '{"name": "exec_command", "arguments": {"cmd": "echo hello-from-codex-tool"}}',
         "namespace": '{"name": "multi_agent_v1__close_agent", "arguments": {"target": "no-such-agent"}}'}
ANSWER = ("The tool", " ran; hello", " from kvwake.")


def scripted_model(path: Path, call: str) -> Path:
    make_scripted_model(path, ("<tool_call>", CALLS[call], "</tool_call>"), template=after_tool_template(),
                        more=[("\t", ANSWER)])
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((path / name).read_text())
        config[key] = 131072
        (path / name).write_text(json.dumps(config))
    return path


def codex_home(home: Path, d: Daemon, hosted: str) -> dict[str, str]:
    """CODEX_HOME with the kvwake provider (docs/http.md); the environment Codex runs in."""
    config = openai_config(d.socket)
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model = "local"\nmodel_provider = "kvwake"\n' + ('web_search = "disabled"\n' if hosted == "disabled" else "")
        + f'\n[model_providers.kvwake]\nname = "kvwake"\nbase_url = "{config["base_url"]}"\n'
        'env_key = "KVWAKE_KEY"\nwire_api = "responses"\n')
    return {**os.environ, "CODEX_HOME": str(home), "KVWAKE_KEY": config["api_key"]}


def turn(codex: Path, env: dict[str, str], work: Path, args: list[str]) -> dict:
    start = time.monotonic()
    out = subprocess.run([str(codex), "exec", *args, "--json", "--skip-git-repo-check",
                          "--dangerously-bypass-approvals-and-sandbox"], cwd=work, env=env, capture_output=True,
                         text=True, timeout=3600, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0:
        raise RuntimeError(f"codex exited {out.returncode}: {out.stdout[-3000:]} {out.stderr[-3000:]}")
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    usage = next((e["usage"] for e in events if e.get("type") == "turn.completed"), None)
    return {"wall_s": round(wall, 1), "items": items, "usage": usage,
            "errors": [e for e in events if e.get("type") in ("error", "turn.failed")]}


def run_turns(codex: Path, work: Path, call: str, hosted: str) -> tuple[list[dict], list[str]]:
    """Three `codex exec` turns in `work` (a fresh folder) against a daemon on the scripted model, the third
    after a restart: each turn's row, and the daemon's log problems (tests/test_agent_clis.py runs it too)."""
    (work / "project").mkdir()
    model = scripted_model(work / "scripted", call)
    extra = ["--http", "0", *(["--http-hosted-tools", "refuse"] if hosted == "disabled" else [])]
    d = Daemon(work / "d", model, block_tokens=128, extra=extra)
    (work / "d").mkdir()
    rows: list[dict] = []
    try:
        d.start(timeout=120)
        env = codex_home(work / "codex-home", d, hosted)
        for i, args in enumerate([["Say hello"], ["resume", "--last", "Say it again"],
                                  ["resume", "--last", "And once more"]]):
            if i == 2:
                assert d.stop() == 0
                d.start(timeout=120)
                env = codex_home(work / "codex-home", d, hosted)  # the port changed
            row = {"turn": i + 1, "args": args, "after_restart": i == 2, **turn(codex, env, work / "project", args)}
            # Codex's usage adds up over the thread: this turn's is the difference.
            before = rows[-1]["usage"] if rows else {}
            row["turn_usage"] = {k: v - before.get(k, 0) for k, v in row["usage"].items()}
            row["turn_usage"]["computed_input_tokens"] = (row["turn_usage"]["input_tokens"]
                                                          - row["turn_usage"]["cached_input_tokens"])
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    finally:
        d.stop()
    return rows, d.log_problems()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--hosted", choices=["omit", "disabled"], default="omit")
    ap.add_argument("--call", choices=sorted(CALLS), default="exec")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu"))
    a = ap.parse_args()
    codex = npm_binary("@openai/codex", "codex", a.version)
    rows, problems = run_turns(codex, Path(tempfile.mkdtemp(prefix="kvwake-codex-")), a.call, a.hosted)
    report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
              "codex": a.version, "hosted": a.hosted, "call": a.call, "turns": rows,
              "daemon_log_problems": problems}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"codex_cli_{a.call}_{a.hosted}.json").write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
