"""The daemon as users meet it: a real `kvwake serve` process on a real socket, tiny model."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from testkit.daemon import Daemon, RawClient, RpcError
from testkit.tinymodel import make_model_dir

SYSTEM = "You are a terse agent that uses tools. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    """One daemon for the tests that only talk to it, each on sessions of its own; tests that stop, kill or
    restart a daemon start their own."""
    d = Daemon(tmp_path_factory.mktemp("daemon"), model_dir).start()
    yield d
    assert d.stop() == 0


def chat(c: RawClient, sid: str, text: str, **kw):
    return c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": text}], max_tokens=8, **kw)


def scenario(c: RawClient, name: str, i: int) -> list:
    """A client's own work: chat, sleep, chat (wakes), fork, chat on the fork, delete the fork."""
    c.call("session.create", session_id=name, system=SYSTEM)
    out = [chat(c, name, f"task {i}: list files")["tokens"]]
    c.call("session.sleep", session_id=name)
    out.append(chat(c, name, f"task {i}: now open one")["tokens"])
    fork = c.call("session.fork", session_id=name, new_session_id=f"{name}-fork")["session_id"]
    out.append(chat(c, fork, "in the fork")["tokens"])
    c.call("session.delete", session_id=fork)
    out.append(chat(c, name, "back in the original")["tokens"])
    return out


def test_sixteen_concurrent_clients_get_exactly_what_they_would_alone(daemon):
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with daemon.client() as c:
                results[i] = scenario(c, f"c{i}", i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with daemon.client() as c:  # the same work alone, one at a time, on fresh sessions
        for i in (0, 7, 15):
            assert scenario(c, f"alone{i}", i) == results[i], f"client {i} saw cross-talk"
        assert {s["session_id"] for s in c.call("session.list")["sessions"]} >= {f"c{i}" for i in range(16)}


def test_sigterm_sleeps_every_session_and_restart_continues_token_identically(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    expected = {}
    with d.client() as c:
        for i in range(3):
            for sid in (f"s{i}", f"twin{i}"):
                c.call("session.create", session_id=sid, system=SYSTEM)
                chat(c, sid, f"question {i}")
            expected[i] = chat(c, f"twin{i}", "follow up")["tokens"]  # the never-slept continuation
    assert d.stop() == 0
    assert not d.socket.exists()
    log = d.log.read_text()
    assert all(f'"session": "s{i}"' in log for i in range(3))
    d.start()
    with d.client() as c:
        assert {s["state"] for s in c.call("session.list")["sessions"]} == {"asleep"}
        for i in range(3):
            assert chat(c, f"s{i}", "follow up")["tokens"] == expected[i]
    d.stop()


def test_kill_9_during_sleeps_loses_nothing_beyond_the_last_snapshot(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    committed: dict[str, int] = {}
    with d.client() as c:
        for i in range(6):
            c.call("session.create", session_id=f"k{i}", system=SYSTEM)
            chat(c, f"k{i}", "first")
            c.call("session.sleep", session_id=f"k{i}")
            committed[f"k{i}"] = c.call("session.info", session_id=f"k{i}")["tokens"]
            chat(c, f"k{i}", "second, not yet slept")
        ids = [c.send("session.sleep", {"session_id": f"k{i}"}) for i in range(6)]
        time.sleep(random.Random(1).uniform(0.0, 0.05))
        d.stop(signal.SIGKILL)
        del ids
    d.start()
    with d.client() as c:
        for sid, tokens in committed.items():
            info = c.call("session.info", session_id=sid)
            assert info["tokens"] >= tokens, f"{sid} lost its committed snapshot"
            assert chat(c, sid, "still here?")["finish_reason"] in ("stop", "length")
        assert c.call("store.fsck")["ok"]
    d.stop()


def test_bundle_mismatch_after_restart_with_another_model(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    with d.client() as c:
        c.call("session.create", session_id="a", system=SYSTEM)
        chat(c, "a", "hello")
    d.stop()
    other = Daemon(tmp_path, make_model_dir(tmp_path / "other", seed=9)).start()
    with other.client() as c, pytest.raises(RpcError) as err:
        chat(c, "a", "who are you?")
    assert err.value.code == "BUNDLE_MISMATCH" and "model.safetensors" in err.value.message
    other.stop()
    d.start()
    with d.client() as c:  # the snapshot is intact for its own model
        assert chat(c, "a", "back")["tokens"]
    d.stop()


def test_busy_session_and_errors_name_what_failed(daemon):
    with daemon.client() as a, daemon.client() as b:
        a.call("session.create", session_id="s", system=SYSTEM)
        first = a.send("session.chat", {"session_id": "s", "messages": [{"role": "user", "content": "go"}],
                                        "max_tokens": 400, "stream": True})
        a.until_streaming(first)  # its first piece is out: the chat holds the session
        with pytest.raises(RpcError) as err:
            chat(b, "s", "me too")
        assert err.value.code == "BUSY" and err.value.data["busy_with"] == "chat"
        assert a.receive(first)["tokens"]
        for call, code in [(lambda: b.call("session.info", session_id="nope"), "NOT_FOUND"),
                           (lambda: b.call("no.such.method"), "UNKNOWN_METHOD"),
                           (lambda: b.call("session.chat", session_id="s", messages="x"), "INVALID_PARAMS"),
                           (lambda: b.call("session.create", session_id="../x"), "INVALID_PARAMS"),
                           (lambda: b.call("session.generate", session_id="s", max_tokens=-1), "INVALID_PARAMS"),
                           (lambda: b.call("session.sleep", session_id="s", bogus=1), "INVALID_PARAMS"),
                           (lambda: b.call("snapshot.export", snapshot_id="x", path="relative.kvsnap"), "INVALID_PARAMS"),
                           (lambda: b.call("snapshot.import", path=str(daemon.data_dir / "store" / "index.sqlite")),
                            "INVALID_PARAMS")]:
            with pytest.raises(RpcError) as err:
                call()
            assert err.value.code == code, err.value


def test_disconnect_mid_stream_cancels_and_leaves_the_session_consistent(daemon):
    c = daemon.client()
    c.call("session.create", session_id="left", system=SYSTEM)
    c.until_streaming(c.send("session.chat", {"session_id": "left", "max_tokens": 100000, "stream": True,
                                              "messages": [{"role": "user", "content": "talk"}]}))
    c.close()
    with daemon.client() as d:
        deadline = time.monotonic() + 30
        while d.call("session.info", session_id="left")["busy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        info = d.call("session.info", session_id="left")
        assert info["busy"] is None and info["tokens"] < 100000
        assert chat(d, "left", "are you there?")["tokens"]


def test_socket_is_private_and_a_second_daemon_refuses_to_start(daemon, model_dir):
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket.parent.stat().st_mode) == 0o700
    second = Daemon(daemon.root, model_dir)
    with pytest.raises(RuntimeError, match="already serving"):
        second.start()
    assert second.proc.returncode == 2


def test_stale_socket_of_a_dead_daemon_is_replaced(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    d.stop(signal.SIGKILL)
    assert d.socket.exists()
    d.start()
    with d.client() as c:
        assert c.call("hello", client="test", protocol=1)["protocol"] == 1
    d.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_a_client_of_another_uid_is_refused(tmp_path, model_dir):
    # The other uid must be able to reach the socket, so only SO_PEERCRED stands in its way.
    public = Path(tempfile.mkdtemp(prefix="kvwake-uid-"))
    public.chmod(0o755)
    d = Daemon(tmp_path, model_dir, extra=["--socket", str(public / "run" / "kvwake.sock")])
    d.socket = public / "run" / "kvwake.sock"
    d.start()
    try:
        os.chmod(d.socket.parent, 0o755)
        os.chmod(d.socket, 0o666)
        code = ("import socket,os,sys\nos.setuid(65534); s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                "try:\n s.sendall(bytes([0x94,0,1,0xa5])+b'hello'+bytes([0x80])); s.settimeout(10); print(repr(s.recv(100)))\n"
                "except (ConnectionResetError, BrokenPipeError):\n print(repr(b''))")  # closed unread: reset or EPIPE
        out = subprocess.run([sys.executable, "-S", "-c", code, str(d.socket)], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0 and out.stdout.strip() == "b''", out  # closed without an answer
        assert '"event": "refused connection", "uid": 65534' in d.log.read_text()
        with d.client() as c:
            assert c.call("hello")["server"] == "kvwake"
    finally:
        d.stop()
        shutil.rmtree(public, ignore_errors=True)


def test_idle_and_budget_limits_put_sessions_to_sleep(tmp_path, model_dir):
    (tmp_path / "cfg.toml").write_text("lifecycle_interval_s = 0.1\nidle_timeout_s = 1.0\n")
    d = Daemon(tmp_path, model_dir, env={"KVWAKE_CONFIG": str(tmp_path / "cfg.toml")}).start()
    with d.client() as c:
        c.call("session.create", session_id="idle", system=SYSTEM)
        chat(c, "idle", "hi")
        deadline = time.monotonic() + 20
        while c.call("session.info", session_id="idle")["state"] == "hot" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.call("session.info", session_id="idle")["state"] == "asleep"
        assert c.call("status")["counters"]["auto_sleeps"] >= 1
    d.stop()
    (tmp_path / "cfg.toml").write_text("lifecycle_interval_s = 0.1\nhot_budget_bytes = 1\n")
    d.start()
    with d.client() as c:
        chat(c, "idle", "wake up")
        deadline = time.monotonic() + 20
        while c.call("status")["sessions"]["hot"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.call("status")["sessions"] == {"hot": 0, "asleep": 1}
    d.stop()


def test_two_daemons_started_at_once_one_serves_the_other_exits(tmp_path, model_dir):
    # Was: both found no socket while loading their models, and both came up on one store.
    a, b = Daemon(tmp_path, model_dir), Daemon(tmp_path, model_dir)
    b.log = tmp_path / "daemon-b.log"
    outcomes = []
    threads = [threading.Thread(target=lambda d=d: outcomes.append(_start_or_error(d))) for d in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(outcomes) == ["exited 2", "ready"], outcomes
    (loser,) = [d for d in (a, b) if d.proc.poll() == 2]
    assert "already serving (or starting on)" in loser.log.read_text()
    for d in (a, b):
        if d.proc.poll() is None:
            assert d.stop() == 0


def _start_or_error(d: Daemon) -> str:
    try:
        d.start()
        return "ready"
    except RuntimeError:
        return _start_state(d)


def _start_state(d: Daemon) -> str:
    return f"exited {d.proc.returncode}" if d.proc.poll() is not None else "ready"


def test_chat_usage_counts_the_prefill_of_its_messages(daemon):
    # Was: prompt_tokens 1 and ttft_ms without the prefill (append prefills all but the last token).
    with daemon.client() as c:  # a system prompt of its own: no other test's stored blocks shorten its prefill
        c.call("session.create", session_id="u", system="You count every token you are given. " * 3)
        reply = chat(c, "u", "count me")
        usage, append = reply["usage"], reply["append"]
        assert usage["prompt_tokens"] == append["prefilled"] + 1 == append["tokens"] - append["reused"]
        assert usage["prefilled_tokens"] == append["prefilled"] > 100


def test_a_session_killed_before_its_first_sleep_keeps_its_system_prompt(tmp_path, model_dir):
    # Was: listed as asleep after the restart, but every call failed with NOT_FOUND ("has no snapshot").
    # Without continuous persistence (which would keep the first turn too: tests/test_persist.py), only the
    # session's first, empty snapshot holds it.
    d = Daemon(tmp_path, model_dir, extra=["--no-persist"]).start()
    with d.client() as c:
        c.call("session.create", session_id="fresh", system=SYSTEM, metadata={"owner": "agent-7"})
        chat(c, "fresh", "first turn, never slept")
    d.stop(signal.SIGKILL)
    d.start()
    with d.client() as c:
        reply = chat(c, "fresh", "still there?")
        assert reply["append"]["tokens"] > len(SYSTEM) // 4  # the system prompt is part of the rendered turn
        info = c.call("session.info", session_id="fresh")
        assert info["mode"] == "chat" and info["messages"] == 3 and info["metadata"] == {"owner": "agent-7"}
    d.stop()


def test_checkpoints_of_an_asleep_session_keep_every_label(daemon):
    # Was: a second checkpoint of the same asleep state moved the label, so the first checkpoint was lost.
    with daemon.client() as c:
        c.call("session.create", session_id="cp", system=SYSTEM)
        chat(c, "cp", "hello")
        c.call("session.sleep", session_id="cp")
        c.call("session.checkpoint", session_id="cp", label="v1")
        c.call("session.checkpoint", session_id="cp", label="v2")
        labels = {s["label"] for s in c.call("snapshot.list", session_id="cp")["snapshots"]}
        assert {"v1", "v2"} <= labels
        with pytest.raises(RpcError) as err:
            c.call("session.wake", session_id="cp", snapshot_id=42)
        assert err.value.code == "INVALID_PARAMS"


def test_a_file_in_the_sockets_place_is_not_deleted(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir)
    d.socket.parent.mkdir(parents=True)
    d.socket.write_text("precious")
    with pytest.raises(RuntimeError, match="not a socket"):
        d.start()
    assert d.socket.read_text() == "precious"
