"""Connections that end badly: clients that vanish at any moment, a daemon stopped under load, and a
client that stops reading. None of them leaves a traceback in the log or hurts another client."""

from __future__ import annotations

import signal
import socket
import threading
import time

import msgpack
import pytest

from testkit.daemon import Daemon
from tests.test_daemon import SYSTEM, chat
from testkit.tinymodel import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A 64k context: a stalled client's million-token stream is capped there, and must outlast its buffers.
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=65536)


def raw(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(d.socket))
    s.settimeout(30)
    return s


def request(msgid: int, method: str, **params) -> bytes:
    return msgpack.packb([0, msgid, method, params])


def stream_chat(msgid: int, sid: str, max_tokens: int) -> bytes:
    return request(msgid, "session.chat", session_id=sid, messages=[{"role": "user", "content": "go on"}],
                   max_tokens=max_tokens, stream=True)


def wait_free(c, sid: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while (info := c.call("session.info", session_id=sid))["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return info


def test_clients_that_vanish_at_any_moment_leave_a_clean_log(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    with d.client() as c:
        c.call("session.create", session_id="s", system=SYSTEM)
        chat(c, "s", "first")
        endings = [
            request(1, "hello")[:3],  # half a frame
            request(1, "session.sleep", session_id="s"),  # mid-request
            request(1, "session.wake", session_id="s"),
            stream_chat(1, "s", 50),  # mid-stream (closed before or after the first piece)
            request(1, "session.list") * 200,  # replies the daemon is still writing
        ]
        for data in endings:
            for pause in (0, 0.02, 0.2):
                s = raw(d)
                s.sendall(data)
                time.sleep(pause)
                s.close()
                assert wait_free(c, "s")["busy"] is None
        assert chat(c, "s", "still here?")["tokens"]
    assert d.stop() == 0
    assert d.log_problems() == []


def test_a_daemon_stopped_under_load_leaves_a_clean_log(tmp_path, model_dir):
    """40 clients keep calling hello while SIGTERM arrives. Before the RPC front was an asyncio
    Protocol, asyncio logged "Exception in callback Future.set_result(None) ... InvalidStateError"
    in 5 of 6 such stops (anyio's UNIX stream reads cancelled in the pass their socket turned readable)."""
    d = Daemon(tmp_path, model_dir)
    for _ in range(2):
        d.start()
        stop = threading.Event()

        def hammer() -> None:
            with raw(d) as s:
                try:
                    while not stop.is_set():
                        s.sendall(request(1, "hello"))
                        if not s.recv(1 << 16):
                            return
                except OSError:  # the daemon went away mid-call
                    pass

        clients = [threading.Thread(target=hammer) for _ in range(40)]
        for t in clients:
            t.start()
        time.sleep(0.5)
        assert d.stop(signal.SIGTERM) == 0
        stop.set()
        for t in clients:
            t.join()
        assert d.log_problems() == []


def test_a_client_that_stops_reading_is_dropped_and_its_session_freed(tmp_path, model_dir):
    (tmp_path / "cfg.toml").write_text("out_buffer_bytes = 8192\n")
    d = Daemon(tmp_path, model_dir, env={"KVWAKE_CONFIG": str(tmp_path / "cfg.toml")}).start()
    with d.client() as other:
        other.call("session.create", session_id="s", system=SYSTEM)
        other.call("session.create", session_id="mine", system=SYSTEM)
        stalled = raw(d)
        stalled.sendall(stream_chat(1, "s", 1_000_000))  # and never reads a byte
        deadline = time.monotonic() + 120
        while b"stopped reading" not in d.log.read_bytes():
            assert time.monotonic() < deadline, "the stalled client was never dropped"
            assert other.call("hello")["server"] == "kvwake"  # served all along
            busy = other.call("session.info", session_id="s")["busy"]
            # held until dropped (the drop may come between the look at the log and this call)
            assert busy == "chat" or b"stopped reading" in d.log.read_bytes(), busy
            time.sleep(0.1)
        info = wait_free(other, "s")
        assert info["busy"] is None and info["tokens"] < 1_000_000
        assert chat(other, "s", "usable again?")["tokens"]
        assert chat(other, "mine", "and mine")["tokens"]
        dropped = next(line for line in d.log.read_text().splitlines() if "stopped reading" in line)
        assert '"out_buffer_bytes": 8192' in dropped and '"calls_in_flight": 1' in dropped
        try:  # the connection is over: what the kernel held, then the end
            while stalled.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        stalled.close()
    assert d.stop() == 0
    assert d.log_problems() == []
