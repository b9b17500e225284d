"""The shared tier against a real SeaweedFS: two real daemons, separate data dirs, one bucket prefix."""

from __future__ import annotations

import time

import pytest

from tests.daemon import Daemon, RawClient, RpcError
from tests.seaweed import BUCKET, Seaweed

SYSTEM = "You are a terse agent that uses tools. " * 3
DOC = "".join(f"Section {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}. " for i in range(17))  # ~1k tokens


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    server = Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


def remote_daemon(root, model_dir, weed: Seaweed, prefix: str, **env: str) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    return Daemon(root, model_dir, extra=["--remote", f"s3://{BUCKET}/{prefix}"], env={**weed.env, **env})


def chat(c: RawClient, sid: str, text: str, **kw):
    return c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": text}], max_tokens=8, **kw)


def wait_remote(c: RawClient, state: str = "ok", timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        remote = c.call("status")["remote"]
        if remote["state"] == state:
            return remote
        time.sleep(0.1)
    raise AssertionError(f"remote never became {state}: {remote}")


def test_a_session_slept_on_one_daemon_wakes_on_another_and_continues_identically(tmp_path, model_dir, weed):
    a = remote_daemon(tmp_path / "a", model_dir, weed, "handover").start()
    b = remote_daemon(tmp_path / "b", model_dir, weed, "handover").start()
    with a.client() as ca, b.client() as cb:
        wait_remote(ca), wait_remote(cb)
        for sid in ("agent", "twin"):
            ca.call("session.create", session_id=sid, system=SYSTEM)
            chat(ca, sid, "list the files")
        slept = ca.call("session.sleep", session_id="agent", release=True)
        assert slept["released"] is True
        listed = {s["session_id"]: s["state"] for s in cb.call("session.list")["sessions"]}
        assert listed["agent"] == "remote" and "twin" not in listed  # only published sessions show
        expected = [chat(ca, "twin", "now open one")["tokens"], chat(ca, "twin", "and close it")["tokens"]]

        assert chat(cb, "agent", "now open one")["tokens"] == expected[0]  # B adopted it: exact continuation
        with pytest.raises(RpcError) as busy:  # two daemons never both append: B holds the lease now
            chat(ca, "agent", "and close it")
        assert busy.value.code == "BUSY" and busy.value.data["owner"] == cb.call("status")["remote"]["daemon"]

        cb.call("session.sleep", session_id="agent", release=True)  # hand it back: A takes B's newest state
        assert chat(ca, "agent", "and close it")["tokens"] == expected[1]
        assert cb.call("status")["remote"]["uploaded_snapshots"] >= 1
    assert a.stop() == 0 and b.stop() == 0


def test_a_held_session_is_refused_to_others_until_taken_over(tmp_path, model_dir, weed):
    a = remote_daemon(tmp_path / "a", model_dir, weed, "held").start()
    b = remote_daemon(tmp_path / "b", model_dir, weed, "held").start()
    with a.client() as ca, b.client() as cb:
        wait_remote(ca), wait_remote(cb)
        ca.call("session.create", session_id="s", system=SYSTEM)
        chat(ca, "s", "hello")
        assert ca.call("session.sleep", session_id="s", remote_wait=True)["released"] is False
        with pytest.raises(RpcError) as busy:
            cb.call("session.wake", session_id="s")
        assert busy.value.code == "BUSY" and "take it over" in busy.value.message
        assert cb.call("snapshot.list")["snapshots"] == []  # nothing fetched for a refused wake
        woken = cb.call("session.wake", session_id="s", take_over=True)  # A is presumed dead
        assert woken["tokens"] > 0
    a.stop(), b.stop()
