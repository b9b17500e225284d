"""`kvwake demo`: the point of kvwake in two minutes, with real numbers.

1. Start a daemon (its own socket; the default model unless --model).
2. An agent session with a long system prompt chats, then sleeps.
3. The daemon is restarted; the session wakes and continues the conversation.
4. For comparison, an equally long conversation the store has never seen is
   prefilled from scratch (what resuming costs without kvwake).
5. A second agent with the same system prompt starts from the prefix cache.
6. A summary with timings; the daemon is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvwake.client.client import Client
from kvwake.client.output import echo_json, json_option
from kvwake.client.wire import ClientConnectionError

__all__ = ["demo"]

MANUAL = """You are a build agent for a large Python monorepo. Follow this tool manual exactly.
Tools: `run(cmd)` runs a shell command in the repository root and returns stdout, stderr and the exit code.
`read(path, start, end)` returns lines of a file. `write(path, text)` replaces a file. `search(pattern)` greps.
Rules: never edit generated files under build/ or dist/. Run the narrowest test that proves a change before
the full suite. Every fix gets a test that fails without it. Keep commits small and describe what changed and why.
When a command fails, read its output before retrying; never retry the same command more than twice.
Prefer reading the code over guessing. Report what you ran and what you saw, with numbers, not adjectives.
The repository uses pytest, ruff and mypy; the CI entry point is .ci/run, which must stay green on every commit.
Dependencies are pinned in pyproject.toml; adding one needs a reason written in the commit message.
"""
QUESTIONS = ("The test suite fails with ImportError in tests/test_api.py. What do you run first?",
             "It was a missing dependency. How do you add it?")


class DemoDaemon:
    """A `kvwake serve` subprocess on a private socket, restartable."""

    def __init__(self, socket: Path, data_dir: Path | None, model: str | None) -> None:
        self.socket, self.log = socket, socket.with_suffix(".log")
        self.args = [sys.executable, "-m", "kvwake.client.cli", "serve", "--socket", str(socket)]
        self.args += ["--data-dir", str(data_dir)] if data_dir else []
        self.args += ["--model", model] if model else []
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        started = time.perf_counter()
        self.socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log)
        while True:
            if self.proc.poll() is not None:
                raise click.ClickException(f"the daemon exited ({self.proc.returncode}); see {self.log}")
            try:
                with Client(self.socket, connect_timeout=1.0) as c:
                    c.hello()
                return time.perf_counter() - started
            except ClientConnectionError:
                time.sleep(0.2)

    def stop(self) -> float:
        """SIGTERM (every hot session sleeps first); returns how long the stop took."""
        started = time.perf_counter()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(300)
        return time.perf_counter() - started


QUIET = {"on": False}  # --json: only the final document is printed


def _say(text: str) -> None:
    if not QUIET["on"]:
        click.echo(click.style("• ", fg="cyan") + text)


def _chat(client: Client, session_id: str, text: str, max_tokens: int) -> Any:
    reply = client.chat(session_id, [{"role": "user", "content": text}], max_tokens=max_tokens)
    if not QUIET["on"]:
        click.echo(click.style("  agent: ", dim=True) + reply.text.strip().replace("\n", " ")[:160])
    return reply


def run_demo(socket: Path, data_dir: Path | None, model: str | None, max_tokens: int) -> dict[str, Any]:
    daemon, tag = DemoDaemon(socket, data_dir, model), f"{int(time.time())}"
    facts: dict[str, Any] = {"start_s": daemon.start()}
    try:
        with Client(socket, timeout=600) as c:
            _say(f"daemon up in {facts['start_s']:.1f} s serving {c.hello()['model']}")
            # A per-run first line keeps the first agent cold even when an earlier demo stored this manual.
            system = f"Demo run {tag}.\n{MANUAL}"
            agent = f"demo-agent-{tag}"
            c.create_session(agent, system=system)
            first = _chat(c, agent, QUESTIONS[0], max_tokens)
            facts["first_prefill"], facts["first_ttft_ms"] = first.usage["prefilled_tokens"], first.usage["ttft_ms"]
            slept = c.sleep(agent)
            facts["slept"] = slept
            _say(f"slept {slept['tokens']} tokens: {slept['raw_bytes'] / 1e6:.1f} MB of KV stored as "
                 f"{slept['stored_bytes'] / 1e6:.1f} MB in {slept['ms']:.0f} ms; memory freed")
        facts["stop_s"] = daemon.stop()
        _say(f"daemon stopped ({facts['stop_s']:.1f} s) and restarted ({daemon.start():.1f} s)")
        with Client(socket, timeout=600) as c:
            woke = c.wake(agent)
            facts["wake_ms"] = woke["ms"]
            _say(f"woke {woke['tokens']} tokens in {woke['ms']:.0f} ms ({woke['blocks_from_disk']} blocks from disk), "
                 "no re-prefill")
            second = _chat(c, agent, QUESTIONS[1], max_tokens)
            facts["after_wake_ttft_ms"] = second.usage["ttft_ms"]
            # The same conversation but for one character of its system prompt: nothing of it is stored,
            # so this is what resuming costs without kvwake (a full re-prefill).
            cold = f"demo-cold-{tag}"
            c.create_session(cold, system="Z" + system)
            turns = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.text},
                     {"role": "user", "content": QUESTIONS[1]}]
            started = time.perf_counter()
            append = c.append(cold, turns)
            facts["reprefill_s"] = time.perf_counter() - started
            facts["reprefill_tokens"] = append["tokens"]
            _say(f"without kvwake: re-prefilling a conversation of {append['tokens']} tokens took "
                 f"{facts['reprefill_s']:.1f} s")
            peer = f"demo-peer-{tag}"
            c.create_session(peer, system=system)
            third = _chat(c, peer, "Which command runs the CI locally?", max_tokens)
            facts["peer_reused"], facts["peer_ttft_ms"] = third.usage["reused_tokens"], third.usage["ttft_ms"]
            _say(f"a second agent with the same system prompt reused {third.usage['reused_tokens']} tokens from the "
                 f"prefix cache and prefilled {third.usage['prefilled_tokens']}: first token in "
                 f"{third.usage['ttft_ms'] / 1000:.1f} s (the first agent needed {first.usage['ttft_ms'] / 1000:.1f} s)")
            facts["stats"] = c.stats()
            for sid in (agent, cold, peer):  # the demo leaves no sessions behind; gc reclaims their blocks
                c.delete_session(sid)
    finally:
        daemon.stop()
    return facts


def _summary(f: dict[str, Any]) -> None:
    click.echo()
    click.secho("summary", bold=True)
    rows = [
        ("resume after restart (wake)", f"{f['wake_ms']:.0f} ms"),
        (f"re-prefill instead ({f['reprefill_tokens']} tokens)", f"{f['reprefill_s']:.1f} s"),
        ("wake speedup", f"{f['reprefill_s'] * 1000 / max(f['wake_ms'], 1e-3):.0f}x"),
        ("KV stored / raw", f"{f['slept']['stored_bytes'] / 1e6:.1f} / {f['slept']['raw_bytes'] / 1e6:.1f} MB"),
        ("second agent: tokens reused from prefix cache", str(f["peer_reused"])),
        ("second agent: first token", f"{f['peer_ttft_ms'] / 1000:.2f} s vs {f['first_ttft_ms'] / 1000:.2f} s cold"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        click.echo(f"  {name:<{width}}  {value}")


@click.command()
@click.option("--socket", "socket_path", type=click.Path(), help="Socket for the demo daemon (default: a private one).")
@click.option("--data-dir", type=click.Path(), help="Store and converted models (default: kvwake's data dir).")
@click.option("--model", help="mlx-lm model folder (default: SmolLM2-135M-Instruct, converted once).")
@click.option("--max-tokens", default=24, show_default=True, help="Reply length per turn.")
@json_option
def demo(socket_path: str | None, data_dir: str | None, model: str | None, max_tokens: int, as_json: bool) -> None:
    """Show sleep, restart, exact wake and prefix reuse on a real model, with timings.

    Runs its own daemon on a private socket and stops it at the end.

    Example: kvwake demo
    """
    from kvwake.client.paths import resolve_socket

    socket = Path(socket_path) if socket_path else resolve_socket(None).with_name(f"kvwake-demo-{os.getpid()}.sock")
    QUIET["on"] = as_json
    facts = run_demo(socket, Path(data_dir) if data_dir else None, model, max_tokens)
    echo_json(facts) if as_json else _summary(facts)
