"""Run a real `kvwake serve` subprocess on a tiny model, and talk to it with a minimal raw client.

`RawClient` speaks msgpack-rpc directly (no kvwake.client), so daemon tests do
not depend on the client library they would otherwise be testing.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from testkit.warmfork import ForkedProcess, can_fork, warm_parent

REPO = Path(__file__).resolve().parent.parent


STARTED: list[Daemon] = []  # every daemon a test started; conftest kills leftovers after each test
CLIENTS: list[Any] = []  # API clients (openai, anthropic) tests made; conftest closes a test's own after it


def track(client: Any) -> Any:
    """`client` (anything with close()), closed after the test that made it (module fixtures' after the module)."""
    CLIENTS.append(client)
    return client


def openai_client(d: Daemon) -> Any:
    """The official `openai` client of a daemon serving HTTP (its URL and token), no retries; closed after the test."""
    import openai

    from kvwake.client import openai_config

    return track(openai.OpenAI(**openai_config(d.socket), max_retries=0, timeout=120))


class Daemon:
    """A `kvwake serve` process with its own socket and data dir."""

    def __init__(self, root: Path, model_dir: Path, *, block_tokens: int = 16, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, fresh: bool = False) -> None:
        """fresh: always start as a new interpreter, never forked from the warm parent (testkit/warmfork.py),
        for a test of the start itself."""
        self.root, self.model_dir, self.fresh = root, model_dir, fresh
        self.socket = root / "run" / "kvwake.sock"
        self.data_dir = root / "data"
        self.log = root / "daemon.log"
        self.args = ["--socket", str(self.socket), "--data-dir", str(self.data_dir), "--model", str(model_dir),
                     "--block-tokens", str(block_tokens), *(extra or [])]
        self.env = {**os.environ, "KVWAKE_CONFIG": str(root / "none.toml"), **(env or {})}
        self.proc: subprocess.Popen | ForkedProcess | None = None

    def start(self, timeout: float = 60.0) -> Daemon:
        offset = self.log.stat().st_size if self.log.exists() else 0  # earlier runs' lines don't count
        with open(self.log, "ab") as log:
            if not self.fresh and can_fork(self.args, self.env):  # the same process, without a fresh interpreter's imports
                self.proc = warm_parent().fork(["kvwake", "serve", *self.args], self.env, REPO, self.log)
            else:
                self.proc = subprocess.Popen([sys.executable, "-m", "kvwake.client.cli", "serve", *self.args],
                                             cwd=REPO, env=self.env, stdout=log, stderr=log)
        if not any(d is self for d in STARTED):  # a restart keeps its place (module-scoped daemons too)
            STARTED.append(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if b'"event": "ready"' in self.log.read_bytes()[offset:]:
                return self
            time.sleep(0.05)
        raise TimeoutError(f"daemon not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # hung: SIGABRT makes its faulthandler write every thread's stack
            with contextlib.suppress(OSError, AttributeError):  # into the log, shown here with the failure; no core
                resource.prlimit(self.proc.pid, resource.RLIMIT_CORE, (0, 0))  # file of a process holding GPU memory
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            print(f"daemon did not stop in {timeout:.0f} s; its log ends:\n{self.log.read_text(errors='replace')[-12000:]}")
            raise
        if code != 0 and sig != signal.SIGKILL:  # shown by pytest when the test then fails
            print(f"daemon exited {code}; its log ends:\n{self.log.read_text(errors='replace')[-4000:]}")
        return code

    def client(self) -> RawClient:
        return RawClient(self.socket)

    def log_problems(self) -> list[str]:
        """Lines of the daemon's log that show a bug: tracebacks (also asyncio's own, "Exception in
        callback ...", which are not JSON) and ERROR records."""
        bad = ("Traceback", "Exception in callback", '"level": "ERROR"', '"level": "CRITICAL"')
        return [line for line in self.log.read_text(errors="replace").splitlines() if any(b in line for b in bad)]


def hot_set_read(c: RawClient, timeout: float = 30.0) -> dict | None:
    """The start's hot set reader's status (kv/hot_set.py) once it has read all it planned (None: switched off)."""
    deadline = time.monotonic() + timeout
    while True:
        status = c.call("status")["restart_prefetch"]
        if status is None or status["state"] in ("held", "dropped", "stopped") or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def freed(c: RawClient, timeout: float = 30.0) -> None:
    """Wait until the KV of every session let go so far is freed (`status` memory's freeing_sessions: a sleep or
    a delete replies first, then frees in the background; over pages a wake or prompt before that maps the pages
    still there). Raises TimeoutError naming what is left."""
    deadline = time.monotonic() + timeout
    while (memory := c.call("status")["memory"])["freeing_sessions"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{memory['freeing_sessions']} sessions' KV still freeing after {timeout} s: {memory}")
        time.sleep(0.01)


def warmed(c: RawClient, timeout: float = 120.0) -> None:
    """Wait until every loaded model's warm-up ran (`model.list` warmed: on CUDA its jobs run in idle moments, and
    what MLX holds moves with them). Raises TimeoutError naming the models still warming."""
    deadline = time.monotonic() + timeout
    while cold := [m["name"] for m in c.call("model.list")["models"] if m["state"] == "loaded" and not m["warmed"]]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"models {cold} still warming after {timeout} s")
        time.sleep(0.05)


def get(url: str, headers: dict | None = None, body: bytes | None = None) -> tuple[int, dict]:
    """A raw HTTP request (what the API client packages would not send): status and JSON body."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def serving_http(root: Path, model_dir: Path) -> Iterator[Daemon]:
    """A module fixture's body: a daemon serving HTTP on a free port; stopped after, its log checked."""
    d = Daemon(root, model_dir, extra=["--http", "0"]).start()
    yield d
    assert d.stop() == 0
    assert d.log_problems() == []


class RpcError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error['code']}: {error['message']}")
        self.code, self.message, self.data = error["code"], error["message"], error.get("data")


class RawClient:
    """Blocking msgpack-rpc over a Unix socket; collects stream notifications per request."""

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError:  # no daemon there (down, restarting): the socket is not left for the collector
            self.sock.close()
            raise
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0
        self.streamed: dict[int, list[dict[str, Any]]] = {}
        self.answered: dict[int, list] = {}  # responses read while waiting for something else

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, method: str, params: Any = None) -> int:
        self.msgid += 1
        self.sock.sendall(msgpack.packb([0, self.msgid, method, params if params is not None else {}]))
        return self.msgid

    def receive(self, msgid: int) -> Any:
        while msgid not in self.answered:
            self._read()
        message = self.answered.pop(msgid)
        if message[2] is not None:
            raise RpcError(message[2])
        return message[3]

    def until_streaming(self, msgid: int) -> None:
        """Read until request `msgid` has streamed its first piece: it is under way (its session held)."""
        while msgid not in self.streamed and msgid not in self.answered:
            self._read()
        assert msgid in self.streamed, f"request {msgid} was answered without streaming: {self.answered[msgid]}"

    def _read(self) -> None:
        """Take the messages already fed to the unpacker, or else read the socket and take those."""
        if self._take():
            return
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("daemon closed the connection")
        self.unpacker.feed(data)
        self._take()

    def _take(self) -> bool:
        """Stream notifications and responses are kept by their request's id; False if there were none."""
        took = False
        for message in self.unpacker:
            took = True
            if message[0] == 2 and message[1] == "stream":
                self.streamed.setdefault(message[2]["msgid"], []).append(message[2])
            elif message[0] == 1:
                self.answered[message[1]] = message
        return took

    def call(self, method: str, **params: Any) -> Any:
        return self.receive(self.send(method, params))
