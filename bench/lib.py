"""What the workloads share: the machine they ran on, models by name, a real daemon, streamed calls' gaps, reports.

A workload imports this after putting the repository root on sys.path (the test kit, testkit/, lives there too):

    ROOT = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(ROOT))
    from bench.lib import save  # noqa: E402
"""

from __future__ import annotations

import bisect
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testkit.daemon import Daemon, RawClient

ROOT = Path(__file__).resolve().parent.parent


# The machine, and reports

def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    import mlx.core as mx

    return {"system": platform.system(), "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "mlx_device": str(mx.default_device()), "python": platform.python_version(),
            # MLX's CUDA-graph settings as this process (and the daemons it starts) got them; unset: MLX's default
            **{name.lower(): os.environ.get(name) for name in ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER",
                                                                "MLX_CUDA_GRAPH_CACHE_SIZE")}}


def save(report: dict[str, Any], out: str, name: str) -> None:
    """The report as <out>/<name>, and printed."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Models by name

def bench_model(name: str, work: Path) -> Path:
    """`tiny` (the tests' tiny llama), `tiny:ARCH` (the tests' tiny model of another family: gemma3_text,
    lfm2, qwen3_next), `default` (SmolLM2-135M, converted once) or a model folder."""
    if name == "tiny" or name.startswith("tiny:"):
        from testkit.tinymodel import make_model_dir

        arch = name.partition(":")[2]
        if not arch:
            return make_model_dir(work / "tiny-llama", ascii_replies=True)
        return make_model_dir(work / f"tiny-{arch}", arch=arch, ascii_replies=True, max_position_embeddings=65536)
    if name == "default":
        from kvwake.daemon.model.convert import ensure_default_model

        return ensure_default_model(work / "models")
    return Path(name).expanduser().resolve()


def agent_model(name: str, work: Path) -> Path:
    """`--model`: "tiny" (the tiny test model with a 64k context and a tool-call format), "default"
    (SmolLM2, converted into `work`), or a model folder."""
    if name == "tiny":
        from testkit.tinymodel import TOOLS_CHATML, make_model_dir

        return make_model_dir(work / "tiny-64k", ascii_replies=True, template=TOOLS_CHATML,
                              max_position_embeddings=65536)
    if name == "default":
        from kvwake.daemon.model.convert import ensure_default_model

        return ensure_default_model(work / "models")
    return Path(name).expanduser().resolve()


def npm_binary(package: str, name: str, version: str) -> Path:
    """The `name` command of npm `package@version`, installed once under ~/.cache/kvwake-bench."""
    where = Path.home() / ".cache" / "kvwake-bench" / package.rpartition("/")[2] / version
    binary = where / "node_modules" / ".bin" / name
    if not binary.exists():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", f"{package}@{version}"],
                       cwd=where, check=True)
    return binary


# A real daemon and its calls

def start_daemon(root: Path, model: Path, max_batch: int, prefill_step: int, persist: bool = True,
                 config: str = "") -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    # A budget no run reaches: no session is put to sleep in the middle of a measurement.
    (root / "none.toml").write_text(f"prefill_step = {prefill_step}\nhot_budget_bytes = {1 << 40}\n"
                                    f"persist = {'true' if persist else 'false'}\n{config}\n")
    return Daemon(root, model, block_tokens=128, extra=["--max-batch", str(max_batch)]).start(timeout=600)


def openai_api(d: Daemon) -> Any:
    """An `openai.OpenAI` client of the daemon's HTTP API (`serve --http`), without retries."""
    import openai

    from kvwake.client import openai_config

    return openai.OpenAI(**openai_config(d.socket), max_retries=0, timeout=3600)


def start_http(root: Path, model: Path) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    return Daemon(root, model, block_tokens=128, extra=["--http", "0"]).start(timeout=900)


def each_turn(d: Daemon, turns: int) -> Iterator[int]:
    """Turn numbers from 0; the daemon is restarted (SIGTERM: every session sleeps) before turn 5."""
    for turn in range(turns):
        if turn == 5:
            d.stop()
            d.start(timeout=900)
        yield turn


def prompts(n: int) -> list[str]:
    return [f"Agent {i} plans step {i * 7 + 3} of the migration and lists its tools." for i in range(n)]


WORDS = ("tool retry policy budget cache session agent memory plan step verify source answer brief "
         "careful index block prefix token model restore sleep wake store digest bundle").split()


def system_prompt(words: int) -> str:
    return "You are a careful agent. " + " ".join(WORDS[i % len(WORDS)] for i in range(words)) + "."


class Stream:
    """One streamed generate call: piece arrival times, then its tokens; gaps tied to tokens."""

    def __init__(self, client: RawClient, session_id: str, max_tokens: int, params: dict | None = None) -> None:
        self.client, self.session_id, self.max_tokens = client, session_id, max_tokens
        self.params = params or {}  # more of session.generate's params (temperature, logit_bias)
        self.pieces: list[tuple[float, str]] = []
        self.result: dict[str, Any] = {}
        self.started = self.ended = 0.0

    def run(self) -> None:
        c = self.client
        self.started = time.perf_counter()
        msgid = c.send("session.generate", {"session_id": self.session_id, "max_tokens": self.max_tokens,
                                            "stream": True, **self.params})
        while not self.result:
            data = c.sock.recv(1 << 16)
            if not data:
                return
            now = time.perf_counter()
            c.unpacker.feed(data)
            for m in c.unpacker:
                if m[0] == 2 and m[1] == "stream":
                    self.pieces.append((now, m[2]["text"]))
                elif m[0] == 1 and m[1] == msgid:
                    self.result = m[3] or {"error": m[2]}
        self.ended = time.perf_counter()

    def arrivals(self, tokenizer: Any) -> list[tuple[int, float]]:
        """(tokens complete, when) at each piece: a piece's text ends within token k's text."""
        detok, lengths = tokenizer.detokenizer, []
        for t in self.result.get("tokens", []):
            detok.add_token(t)
            lengths.append(len(detok.text))
        out, done = [], 0
        for when, text in self.pieces:
            done += len(text)
            out.append((bisect.bisect_left(lengths, done) + 1, when))
        return out

    def gaps(self, tokenizer: Any, within: tuple[float, float] | None = None) -> list[float]:
        """ms between pieces completed by consecutive tokens (optionally arriving within a window)."""
        return [ms for _, ms in self.timed_gaps(tokenizer, within)]

    def timed_gaps(self, tokenizer: Any, within: tuple[float, float] | None = None) -> list[tuple[float, float]]:
        """`gaps`, each with when it ended (perf_counter time): (when, ms)."""
        out, last = [], None
        for k, when in self.arrivals(tokenizer):
            if last is not None and k == last[0] + 1 and (within is None or within[0] < when < within[1]):
                out.append((when, (when - last[1]) * 1000))
            last = (k, when)
        return out


def gap_stats(stream: Stream, tokenizer: Any, alone_until: float, during: tuple[float, float]) -> dict[str, Any]:
    """The stream's gaps in the window `during` against its median gap before `alone_until`."""
    alone, inside = stream.gaps(tokenizer, (0.0, alone_until)), stream.gaps(tokenizer, during)
    median, p99 = (statistics.median(alone) if alone else None), pct(inside, 0.99)
    return {"gap_alone_p50_ms": round(median, 3) if median else None, "gap_during_p50_ms": pct(inside, 0.5),
            "gap_during_p99_ms": p99, "gap_during_max_ms": round(max(inside), 3) if inside else None,
            "gap_samples_during": len(inside),
            "p99_during_over_p50_alone": round(p99 / median, 2) if p99 and median else None}


def engine_work(status: dict[str, Any], began_wall: float, ended_wall: float) -> list[dict[str, Any]]:
    """The engine thread's jobs and steps over its SLOW_S between two Unix times, by name, `at_s` from
    `began_wall` (KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 in the daemon's environment: all of them)."""
    return [{"what": j["what"], "ms": j["ms"], "at_s": round(j["at"] - began_wall, 3)}
            for j in status["engine_thread"]["slow"] if began_wall <= j["at"] <= ended_wall]


# Servers to compare against

def answered(url: str, proc: subprocess.Popen | None = None, timeout: float = 900.0) -> None:
    """Return once GET `url` answers (any HTTP status: a refusal for want of a token is an answer too);
    RuntimeError if `proc` exits first or `timeout` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"nothing answered {url} (process exit code: "
                                   f"{proc.poll() if proc is not None else None})") from None
            time.sleep(0.05)


def start_mlx_server(model: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`mlx_lm.server` on `model` (its defaults, then `args`) at a free port, its output appended to `log`;
    returns once its /v1/models answers: the process and its OpenAI base URL."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port),
                                 *args], stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        answered(f"{base}/models", proc)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"mlx_lm.server did not start; its log ends:\n{log.read_text(errors='replace')[-2000:]}")
    return proc, base


def peak_rss_bytes(pid: int) -> int | None:
    """A live process's peak resident set (VmHWM); None where there is no /proc (macOS)."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return None
    line = next((row for row in status.read_text().splitlines() if row.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None
