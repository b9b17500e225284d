"""The real Claude Code CLI against kvwake: three turns of `claude -p`, a daemon restart before the third.

usage: python bench/claude_code.py [--version 2.1.332] [--tools ""|default|NAMES] [--out bench/out/cpu]

Installs `@anthropic-ai/claude-code` from npm once (into ~/.cache/kvwake-bench/claude-code),
starts `kvwake serve --http` on a scripted tiny model (testkit/tinymodel.py: any prompt is
answered "Hello from kvwake on MLX."; 1 byte = 1 token; a 128k context), points Claude Code
at it (ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY from `kvwake http`, non-essential traffic off)
and runs `claude -p` three times in one directory: a first turn, `--continue`, then, after
the daemon is stopped (SIGTERM: its sessions sleep) and started again, `--continue` once
more. Per turn: Claude Code's own report (`--output-format json`): the result text, its
time to first token, `input_tokens` (computed) and `cache_read_input_tokens`.
`--tools ""` (the default here) turns Claude Code's built-in tools off, which keeps its
prompt at ~29k tokens on this byte-level tokenizer; `--tools default` leaves Claude Code's own
default (its first request is then 87 KB with 12 tools, three times the 29k-token prompt's
size, on a tokenizer of 1 byte = 1 token: not run on the CPU here). Results: <out>/claude_code.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import npm_binary  # noqa: E402
from kvwake.client import openai_config  # noqa: E402
from testkit.daemon import Daemon  # noqa: E402
from testkit.tinymodel import make_scripted_model  # noqa: E402

VERSION = "2.1.332"  # the current release on npm, tried (docs/http.md)
REPLY = ("Hello", " from", " kvwake", " on", " MLX.")


def scripted_model(path: Path) -> Path:
    make_scripted_model(path, REPLY)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((path / name).read_text())
        config[key] = 131072
        (path / name).write_text(json.dumps(config))
    return path


def turn(claude: Path, d: Daemon, work: Path, prompt: str, tools: str | None, more: list[str]) -> dict:
    """One `claude -p` turn; `tools` is its --tools (None: Claude Code's default tools)."""
    config = openai_config(d.socket)
    env = {**os.environ, "ANTHROPIC_BASE_URL": config["base_url"].removesuffix("/v1"),
           "ANTHROPIC_API_KEY": config["api_key"], "HOME": str(work / "home"),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
    out = subprocess.run([str(claude), "-p", prompt, *more, "--model", "claude-sonnet-4-6",
                          *(["--tools", tools] if tools is not None else []), "--output-format", "json"],
                         cwd=work / "project", env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"claude exited {out.returncode}: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    u = r["usage"]
    return {"result": r["result"], "is_error": r["is_error"], "ttft_ms": r["ttft_ms"], "input_tokens": u["input_tokens"],
            "cache_read_input_tokens": u["cache_read_input_tokens"], "output_tokens": u["output_tokens"]}


def run_turns(claude: Path, work: Path, tools: str | None) -> tuple[list[dict], list[str]]:
    """Three `claude -p` turns in `work` (a fresh folder) against a daemon on the scripted model, the third
    after a restart: each turn's row, and the daemon's log problems (tests/test_agent_clis.py runs it too)."""
    (work / "home").mkdir()
    (work / "project").mkdir()
    model = scripted_model(work / "scripted")
    d = Daemon(work / "d", model, block_tokens=128, extra=["--http", "0"])
    (work / "d").mkdir()
    rows: list[dict] = []
    try:
        d.start(timeout=120)
        for i, (prompt, more) in enumerate([("Say hello", []), ("Say it again", ["--continue"]),
                                            ("And once more", ["--continue"])]):
            if i == 2:
                assert d.stop() == 0
                d.start(timeout=120)
            rows.append({"turn": i + 1, "after_restart": i == 2, **turn(claude, d, work, prompt, tools, more)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        d.stop()
    return rows, d.log_problems()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--tools", default="", help='Claude Code\'s --tools ("" turns its built-in tools off; "default" '
                    "leaves the flag out: its default tools)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu"))
    a = ap.parse_args()
    claude = npm_binary("@anthropic-ai/claude-code", "claude", a.version)
    tools = None if a.tools == "default" else a.tools
    rows, problems = run_turns(claude, Path(tempfile.mkdtemp(prefix="kvwake-claude-code-")), tools)
    report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
              "claude_code": a.version, "tools": a.tools, "turns": rows, "daemon_log_problems": problems,
              "restart_ttft_ratio": round(rows[0]["ttft_ms"] / rows[2]["ttft_ms"], 1)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "claude_code.json").write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
