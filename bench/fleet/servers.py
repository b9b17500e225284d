"""The two servers the fleet runs against: kvwake (`serve --http`) and `mlx_lm.server`, each started and
stopped as a whole process, so a start is timed from the process's start and a restart loses what it held."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from bench.anthropic_turns import api_of
from bench.lib import answered, peak_rss_bytes, start_mlx_server
from kvwake.client import openai_config
from testkit.daemon import Daemon

__all__ = ["Kvwake", "Life", "MlxServer"]


@dataclass(frozen=True)
class Life:
    """One process of a server, from its start to its stop."""

    ready_s: float  # process start to its first answered request (GET /v1/models)
    peak_rss_bytes: int | None  # the process's peak resident set
    mlx_peak_bytes: int | None  # MLX's own peak (kvwake's status; mlx_lm.server does not say)


def _openai(base_url: str, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)


class Kvwake:
    """`kvwake serve --http 0` on its own data dir (a restart keeps the store: SIGTERM sleeps every session)."""

    name = "kvwake"
    model_name = "local"

    def __init__(self, root: Path, model: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.daemon = Daemon(root, model, block_tokens=128, extra=["--http", "0"])
        self.started, self.lives = 0.0, 0

    def start(self) -> float:
        """Start the process; seconds until its HTTP API answers."""
        self.started = time.perf_counter()
        self.daemon.start(timeout=900)
        answered(f"{openai_config(self.daemon.socket)['base_url']}/models", self.daemon.proc)
        return time.perf_counter() - self.started

    def openai(self) -> openai.OpenAI:
        return _openai(**openai_config(self.daemon.socket))

    def anthropic(self) -> Any:
        return api_of(self.daemon)

    def stop(self, ready_s: float) -> Life:
        with self.daemon.client() as rpc:
            status = rpc.call("status")
        memory = status["memory"]
        # Where each turn's first token went (status.turns: render, match, claim, append, first token), the
        # counters and the start's phases, for docs/benchmarks.md's trace: one file per process
        self.lives += 1
        kept = ("turns", "counters", "startup_ms", "engine_thread", "latency", "generation", "persistence", "gc",
                "memory", "tuning", "gil", "store", "restore_points",  # store.point_share: issue 52's share
                "restart_prefetch",  # the hot set read during start-up: what it read, and when
                "pages")  # paged KV's pool (with paged_kv on): pages held, shared, the pool's growths
        trace = {key: status.get(key) for key in kept}
        (self.daemon.root / f"trace-{self.lives}.json").write_text(json.dumps(trace, indent=1, default=str))
        self.daemon.stop()
        return Life(ready_s, memory["peak_rss_bytes"], memory.get("mlx_peak_bytes"))

    def close(self) -> None:
        """Stop the process if it still runs (after a failed run)."""
        if self.daemon.proc is not None and self.daemon.proc.poll() is None:
            self.daemon.stop()


class MlxServer:
    """`mlx_lm.server --model MODEL` with its defaults (it serves the model each request names); OpenAI API only."""

    name = "mlx_lm.server"

    def __init__(self, root: Path, model: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.model, self.log = model, root / "mlx_lm.server.log"
        self.model_name = str(model)
        self.proc: subprocess.Popen | None = None
        self.base_url, self.started = "", 0.0

    def start(self) -> float:
        self.started = time.perf_counter()
        self.proc, self.base_url = start_mlx_server(self.model, self.log)
        return time.perf_counter() - self.started

    def openai(self) -> openai.OpenAI:
        return _openai(self.base_url)

    def stop(self, ready_s: float) -> Life:
        assert self.proc is not None
        peak = peak_rss_bytes(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(120)
        return Life(ready_s, peak, None)

    def close(self) -> None:
        """Stop the process if it still runs (after a failed run)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(120)
