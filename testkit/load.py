"""Load with faults (the load generator `bench/load.py` runs and tests/test_load.py calls): concurrent agents over RPC and HTTP, random disconnects, one kill -9 mid-run.

Half the clients speak msgpack-rpc (testkit/daemon.py's raw client), half the OpenAI API (the `openai`
package, sessions named by X-Kvwake-Session), all against one `kvwake serve --http`. Each one loops
until the time is up, picking at random: a chat turn, a tool turn (a call, then its result sent back),
a sleep, a wake, or a disconnect (a streamed turn abandoned after its first piece, or before). At
--kill-at of the run the daemon is killed (SIGKILL) and started again on the same data dir; calls
meanwhile fail to connect and are counted as "down"; the run goes on for the downtime, so the clients get
--seconds of the daemon's uptime (after one warm-up turn outside the clock). A conversation starts over in a new session
after ROTATE turns (the tiny model's context is 4,096 tokens).

Afterwards, the checks (`failed_checks` names those that fail): every acknowledged sleep wakes, by its snapshot id,
with the tokens it acknowledged (the daemon keeps every snapshot: keep_history is raised); fsck is
clean; no call got INTERNAL (HTTP: 500); the daemon stops cleanly and logs no traceback. Latencies
(ms, calls that succeeded) per front and operation: p50, p99. Default model: testkit/tinymodel.py's
scripted one, whose every reply is a get_weather call.
"""

from __future__ import annotations

import os
import platform
import random
import socket
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai

from kvwake.client import openai_config
from testkit.daemon import Daemon, RawClient, RpcError
from testkit.tinymodel import make_scripted_model

__all__ = ["failed_checks", "run_load"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
OPS = {"chat": 4, "tool": 3, "sleep": 2, "wake": 1, "leave": 1}  # weights
ROTATE = 24  # turns before a conversation starts over in a new session
ALLOWED = {"BUSY", "CANCELLED"}  # a session still busy with a call its client left; a call cut by a stop
# No daemon to answer: refused, reset, or a stream cut mid-way (httpx's error, which openai's stream passes on).
DOWN = (ConnectionError, OSError, openai.APIConnectionError, openai.APITimeoutError, httpx.TransportError)


class Record:
    """Every call's outcome and time, and every acknowledged sleep; shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, str, float, float]] = []  # front, op, outcome, ms, began (monotonic)
        self.acks: list[tuple[str, str, int, float]] = []  # session, snapshot, tokens, when (monotonic)
        self.faults = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)  # outcome: the first few messages, to say what failed
        self.downs: list[tuple[float, str]] = []  # when a call found no daemon (monotonic), and how

    def call(self, front: str, op: str, outcome: str, ms: float, began: float, message: str = "") -> None:
        with self.lock:
            self.calls.append((front, op, outcome, ms, began))
            if message and len(self.examples[outcome]) < 3:
                self.examples[outcome].append(f"{front} {op}: {message}")


def http_outcome(exc: openai.APIStatusError) -> str:
    """The kvwake code an HTTP error stands for (its body's `code`, as the fronts write it); INTERNAL for
    a 500 without one (an unexpected exception)."""
    code = exc.code if isinstance(exc.code, str) else None
    if code == "context_length_exceeded":
        return "CONTEXT_TOO_LONG"
    if code is not None:
        return code.upper()
    return "INTERNAL" if exc.status_code == 500 else f"http {exc.status_code}"


class Agent:
    """One client: its own sessions, one after another; `step` runs one random operation."""

    front = ""

    def __init__(self, n: int, d: Daemon, record: Record, seed: int) -> None:
        self.name, self.d, self.record = f"{self.front}{n}", d, record
        self.rng = random.Random(seed * 1000 + n)
        self.generation, self.turns = 0, 0

    @property
    def sid(self) -> str:
        return f"{self.name}-{self.generation}"

    def step(self) -> None:
        op = self.rng.choices(list(OPS), weights=list(OPS.values()))[0]
        began, at, message = time.perf_counter(), time.monotonic(), ""
        try:
            getattr(self, op)()
            outcome = "ok"
        except RpcError as exc:
            outcome, message = exc.code, f"{exc.message} {exc.data or ''}"
            if exc.code == "CONTEXT_TOO_LONG":
                self.rotate()
        except openai.APIStatusError as exc:
            outcome, message = http_outcome(exc), exc.message
            if outcome == "CONTEXT_TOO_LONG":
                self.rotate()
        except DOWN as exc:
            outcome = "down"
            with self.record.lock:
                self.record.downs.append((time.monotonic(), f"{self.front} {op}: {type(exc).__name__}: {exc}"))
            self.reconnect()
        self.record.call(self.front, op, outcome, (time.perf_counter() - began) * 1000, at,
                         "" if outcome in {"ok", "down", *ALLOWED} else message)
        if outcome == "BUSY":  # a call its client left still holds the session: as a client would, wait a little
            time.sleep(self.rng.uniform(0.02, 0.1))
        if self.turns >= ROTATE:
            self.rotate()

    def rotate(self) -> None:
        self.generation, self.turns = self.generation + 1, 0

    def rpc(self, method: str, **params: Any) -> Any:
        with self.d.client() as c:
            return c.call(method, **params)

    def sleep(self) -> None:
        self.rpc("session.create", session_id=self.sid, exist_ok=True)
        slept = self.rpc("session.sleep", session_id=self.sid)
        if slept.get("snapshot_id") and not slept.get("already_asleep"):
            with self.record.lock:  # a wake gives back its KV's tokens and the pending ones
                self.record.acks.append((self.sid, slept["snapshot_id"], slept["tokens"] + slept["pending"],
                                         time.monotonic()))

    def wake(self) -> None:
        self.rpc("session.create", session_id=self.sid, exist_ok=True)
        self.rpc("session.wake", session_id=self.sid)

    def reconnect(self) -> None:
        time.sleep(self.rng.uniform(0.05, 0.3))

    def close(self) -> None:
        """Close the agent's connections (after the run)."""


class RpcAgent(Agent):
    front = "rpc"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.conn: RawClient | None = None

    def client(self) -> RawClient:
        if self.conn is None:
            self.conn = self.d.client()
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def reconnect(self) -> None:
        self.close()
        super().reconnect()

    def chat(self, messages: list[dict] | None = None, **params: Any) -> dict:
        c = self.client()
        c.call("session.create", session_id=self.sid, exist_ok=True)
        messages = messages or [{"role": "user", "content": f"turn {self.turns}: what next?"}]
        msgid = c.send("session.chat", {"session_id": self.sid, "messages": messages, "max_tokens": 24,
                                        "stream": self.rng.random() < 0.5, **params})
        try:
            result = c.receive(msgid)
        finally:
            c.streamed.pop(msgid, None)
        self.turns += 1
        return result

    def tool(self) -> None:
        first = self.chat([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
        for call in first["tool_calls"]:
            self.chat([{"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'}], tools=TOOLS)

    def leave(self) -> None:
        """A streamed turn abandoned after its first piece (or at once): the connection closes under it."""
        self.client().call("session.create", session_id=self.sid, exist_ok=True)
        with RawClient(self.d.socket) as c:
            c.send("session.chat", {"session_id": self.sid, "max_tokens": 200, "stream": True,
                                    "messages": [{"role": "user", "content": "tell me everything"}]})
            if self.rng.random() < 0.7:
                c.unpacker.feed(c.sock.recv(1 << 16))
        with self.record.lock:
            self.record.faults["disconnects"] += 1
        self.turns += 1


class HttpAgent(Agent):
    front = "http"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.api = openai.OpenAI(**openai_config(self.d.socket), max_retries=0, timeout=120)
        self.history: list[dict] = []

    def rotate(self) -> None:
        super().rotate()
        self.history = []

    def close(self) -> None:
        # Left to the collector, the client's pooled sockets are found in a reference cycle, some finalized
        # before the client's own close: they warn "unclosed socket" in whichever later test collects them
        self.api.close()

    def complete(self, extra: list[dict], **params: Any) -> Any:
        """One request with the whole conversation (as OpenAI clients send it); the reply joins it."""
        messages = self.history + extra
        reply = self.api.chat.completions.create(model="local", messages=messages, max_tokens=24, temperature=0,
                                                 extra_headers={"X-Kvwake-Session": self.sid}, **params)
        said = reply.choices[0].message
        calls = [call.model_dump() for call in said.tool_calls or []]
        self.history = messages + [{"role": "assistant", "content": said.content, **({"tool_calls": calls} if calls else {})}]
        self.turns += 1
        return said

    def chat(self) -> None:
        if self.rng.random() < 0.5:
            self.complete([{"role": "user", "content": f"turn {self.turns}: what next?"}])
            return
        stream = self.api.chat.completions.create(
            model="local", messages=self.history + [{"role": "user", "content": f"turn {self.turns}: go on"}],
            max_tokens=24, stream=True, extra_headers={"X-Kvwake-Session": self.sid})
        for _ in stream:
            pass
        self.turns += 1  # the streamed reply is not kept: the next request's history diverges, as clients' may

    def tool(self) -> None:
        said = self.complete([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
        for call in said.tool_calls or []:
            self.complete([{"role": "tool", "tool_call_id": call.id, "content": "sunny"}], tools=TOOLS)

    def leave(self) -> None:
        stream = self.api.chat.completions.create(
            model="local", messages=self.history + [{"role": "user", "content": "tell me everything"}],
            max_tokens=200, stream=True, extra_headers={"X-Kvwake-Session": self.sid})
        if self.rng.random() < 0.7:
            next(iter(stream), None)
        stream.close()
        with self.record.lock:
            self.record.faults["disconnects"] += 1


def run_clients(d: Daemon, record: Record, clients: int, seconds: float, kill_at: float, seed: int) -> dict:
    """The load, with its kill -9 and restart; returns the restart's facts."""
    agents = [(RpcAgent if n % 2 == 0 else HttpAgent)(n, d, record, seed) for n in range(clients)]
    with d.client() as c:  # one turn first, outside the clock: a GPU backend's first call builds its kernels
        c.call("session.create", session_id="warm-up")
        c.call("session.chat", session_id="warm-up", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    end = [time.monotonic() + seconds]  # `seconds` of the daemon's uptime: the restart's downtime extends it
    restart: dict[str, Any] = {}

    def loop(agent: Agent) -> None:
        while time.monotonic() < end[0]:
            agent.step()

    def killer() -> None:
        time.sleep(seconds * kill_at)
        restart["killed"] = time.monotonic()  # before the signal: clients see the sockets close before wait()
        d.proc.kill()  # returns (a process holding a CUDA context takes a while to be torn down)
        d.proc.wait()
        record.faults["kill -9"] += 1
        d.start(timeout=120)
        restart["back"] = time.monotonic()
        end[0] += restart["back"] - restart["killed"]

    threads = [threading.Thread(target=loop, args=(a,)) for a in agents] + [threading.Thread(target=killer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a in agents:
        a.close()
    return restart


def check(d: Daemon, record: Record, killed: float) -> dict[str, Any]:
    """Every acknowledged sleep wakes with its tokens; fsck is clean."""
    failed: list[dict] = []
    with d.client() as c:
        for sid, snap, tokens, _ in record.acks:
            for _ in range(50):  # a session a departed client's call still holds: a moment
                try:
                    woke = c.call("session.wake", session_id=sid, snapshot_id=snap)
                    if woke["tokens"] != tokens:
                        failed.append({"session": sid, "snapshot": snap, "tokens": tokens, "woke": woke["tokens"]})
                    break
                except RpcError as exc:
                    if exc.code != "BUSY":
                        failed.append({"session": sid, "snapshot": snap, "error": f"{exc.code}: {exc.message}"})
                        break
                    time.sleep(0.1)
        fsck = c.call("store.fsck")
    return {"acknowledged_sleeps": len(record.acks), "acknowledged_before_kill": sum(t < killed for *_, t in record.acks),
            "woke": len(record.acks) - len(failed), "wake_failures": failed,
            "fsck_ok": fsck["ok"], "fsck": {k: fsck[k] for k in ("blocks_checked", "snapshots_checked", "bad_blocks",
                                                                  "damaged_snapshots", "refcounts_fixed")}}


def percentiles(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    at = lambda q: round(ms[min(len(ms) - 1, int(q * len(ms)))], 1)  # noqa: E731
    return {"n": len(ms), "p50_ms": at(0.5), "p99_ms": at(0.99)}


def downs(record: Record, restart: dict[str, float]) -> dict[str, Any]:
    """Calls that found no daemon: while it was down, and outside that window: before the kill (none
    may), and begun after it was back (at most one per client: a connection kept from before)."""
    down = [(began, began + ms / 1000) for _, _, outcome, ms, began in record.calls if outcome == "down"]
    return {"down_s": round(restart["back"] - restart["killed"], 3),
            "down_before_kill": sum(end < restart["killed"] for _, end in down),
            "down_after_restart": sum(began > restart["back"] for began, _ in down),
            "before_kill_examples": [how for at, how in record.downs if at < restart["killed"]][:3]}  # each at its end


def summary(record: Record) -> dict[str, Any]:
    outcomes = Counter(outcome for _, _, outcome, _, _ in record.calls)
    by_op = Counter(f"{front} {op}: {outcome}" for front, op, outcome, _, _ in record.calls if outcome != "ok")
    latency: dict[str, list[float]] = defaultdict(list)
    for front, op, outcome, ms, _ in record.calls:
        if outcome == "ok":
            latency[f"{front} {op}"].append(ms)
    return {"calls": len(record.calls), "outcomes": dict(outcomes), "failed_calls": dict(sorted(by_op.items())),
            "internal": outcomes["INTERNAL"],
            "unexpected": {k: v for k, v in outcomes.items() if k not in {"ok", "down", *ALLOWED}},
            "unexpected_examples": dict(record.examples),
            "faults": dict(record.faults), "latency": {k: percentiles(v) for k, v in sorted(latency.items())}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_load(out: Path, clients: int = 32, seconds: float = 60.0, kill_at: float = 0.5, seed: int = 0,
             model: str = "scripted") -> dict[str, Any]:
    """One run against a fresh daemon on a temporary data dir: the result (every call's outcome, latencies,
    the restart and the checks' facts). `out` receives the daemon's whole log (load-daemon.log)."""
    with tempfile.TemporaryDirectory(prefix="kvwake-load-") as tmp:
        root = Path(tmp)
        model_dir = make_scripted_model(root / "model") if model == "scripted" else Path(model)
        (root / "none.toml").write_text("keep_history = 1000000\n")  # every acknowledged snapshot stays to be woken
        # A fixed port: the restarted daemon serves the same URL (and the same token, from its data dir).
        d = Daemon(root, model_dir, extra=["--http", f"127.0.0.1:{free_port()}"]).start()
        record = Record()
        began = time.monotonic()
        restart = run_clients(d, record, clients, seconds, kill_at, seed)
        elapsed = time.monotonic() - began
        checks = check(d, record, restart["killed"])
        stopped = d.stop()
        problems = d.log_problems()
        out.mkdir(parents=True, exist_ok=True)
        (out / "load-daemon.log").write_bytes(d.log.read_bytes())  # the daemon's whole story, kept with the result
    return {"machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "clients": clients, "seconds": round(elapsed, 1), "seed": seed, "model": model,
            **summary(record), "restart": downs(record, restart), **checks, "stop_exit": stopped,
            "log_problems": problems[:20]}


def failed_checks(result: dict[str, Any]) -> list[str]:
    """The names of the run's checks that failed (none: it passed)."""
    passed = {"no INTERNAL": result["internal"] == 0, "no unexpected outcome": not result["unexpected"],
              "every acknowledged sleep woke": result["woke"] == result["acknowledged_sleeps"],
              "fsck clean": result["fsck_ok"], "clean stop": result["stop_exit"] == 0,
              "no log problems": not result["log_problems"], "one kill -9": result["faults"].get("kill -9") == 1,
              "up before the kill": result["restart"]["down_before_kill"] == 0,
              "back after the restart": result["restart"]["down_after_restart"] <= result["clients"]}
    return [name for name, ok in passed.items() if not ok]
