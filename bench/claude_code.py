"""The real Claude Code CLI against kvwake: three turns of `claude -p`, a daemon restart before the third.

usage: python bench/claude_code.py [--version 2.1.332] [--tools ""] [--out bench/out/cpu]

Installs `@anthropic-ai/claude-code` from npm once (into ~/.cache/kvwake-bench/claude-code),
starts `kvwake serve --http` on a scripted tiny model (testkit/tinymodel.py: any prompt is
answered "Hello from kvwake on MLX."; 1 byte = 1 token; a 128k context), points Claude Code
at it (ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY from `kvwake http`, non-essential traffic off)
and runs `claude -p` three times in one directory: a first turn, `--continue`, then, after
the daemon is stopped (SIGTERM: its sessions sleep) and started again, `--continue` once
more. Per turn: Claude Code's own report (`--output-format json`): the result text, its
time to first token, `input_tokens` (computed) and `cache_read_input_tokens`.
`--tools ""` (the default here) turns Claude Code's built-in tools off, which keeps its
prompt at ~29k tokens on this byte-level tokenizer; without it the prompt is larger and the
first turn's CPU prefill takes many minutes. Results: <out>/claude_code.json.
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

REPLY = ("Hello", " from", " kvwake", " on", " MLX.")


def scripted_model(path: Path) -> Path:
    make_scripted_model(path, REPLY)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((path / name).read_text())
        config[key] = 131072
        (path / name).write_text(json.dumps(config))
    return path


def turn(claude: Path, d: Daemon, work: Path, prompt: str, tools: str, more: list[str]) -> dict:
    config = openai_config(d.socket)
    env = {**os.environ, "ANTHROPIC_BASE_URL": config["base_url"].removesuffix("/v1"),
           "ANTHROPIC_API_KEY": config["api_key"], "HOME": str(work / "home"),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
    out = subprocess.run([str(claude), "-p", prompt, *more, "--model", "claude-sonnet-4-6", "--tools", tools,
                          "--output-format", "json"], cwd=work / "project", env=env, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"claude exited {out.returncode}: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    u = r["usage"]
    return {"result": r["result"], "is_error": r["is_error"], "ttft_ms": r["ttft_ms"], "input_tokens": u["input_tokens"],
            "cache_read_input_tokens": u["cache_read_input_tokens"], "output_tokens": u["output_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="2.1.332")
    ap.add_argument("--tools", default="", help='Claude Code\'s --tools ("" turns its built-in tools off)')
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu"))
    a = ap.parse_args()
    claude = npm_binary("@anthropic-ai/claude-code", "claude", a.version)
    work = Path(tempfile.mkdtemp(prefix="kvwake-claude-code-"))
    (work / "home").mkdir()
    (work / "project").mkdir()
    model = scripted_model(work / "scripted")
    d = Daemon(work / "d", model, block_tokens=128, extra=["--http", "0"])
    (work / "d").mkdir()
    rows = []
    try:
        d.start(timeout=120)
        for i, (prompt, more) in enumerate([("Say hello", []), ("Say it again", ["--continue"]),
                                            ("And once more", ["--continue"])]):
            if i == 2:
                assert d.stop() == 0
                d.start(timeout=120)
            rows.append({"turn": i + 1, "after_restart": i == 2, **turn(claude, d, work, prompt, a.tools, more)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        d.stop()
    report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} cores",
              "claude_code": a.version, "tools": a.tools, "turns": rows,
              "restart_ttft_ratio": round(rows[0]["ttft_ms"] / rows[2]["ttft_ms"], 1)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "claude_code.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
