"""The shared tier against a real SeaweedFS: two real daemons, separate data dirs, one bucket prefix."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from testkit.daemon import Daemon, RawClient, RpcError
from testkit.seaweed import BUCKET, Seaweed

SYSTEM = "You are a terse agent that uses tools. " * 3
DOC = "".join(f"Section {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}. " for i in range(18))  # ~1k tokens


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    server = Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.kill()  # nothing of it is kept: no graceful stop (seconds) to wait for


def remote_daemon(root, model_dir, weed: Seaweed, prefix: str, **env: str) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    return Daemon(root, model_dir, extra=["--remote", f"s3://{BUCKET}/{prefix}"], env={**weed.env, **env})


@contextlib.contextmanager
def two_daemons(tmp_path, model_dir, weed: Seaweed, prefix: str) -> Iterator[tuple[RawClient, RawClient]]:
    """Daemons A and B, separate data dirs, one bucket prefix; both connected; both stop cleanly after."""
    a = remote_daemon(tmp_path / "a", model_dir, weed, prefix).start()
    b = remote_daemon(tmp_path / "b", model_dir, weed, prefix).start()
    with a.client() as ca, b.client() as cb:
        wait_remote(ca), wait_remote(cb)
        yield ca, cb
    assert a.stop() == 0 and b.stop() == 0


def chat(c: RawClient, sid: str, text: str, **kw):
    return c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": text}], max_tokens=8, **kw)


def released_with_twin(c: RawClient, sid: str, text: str) -> None:
    """`sid` and its never-slept twin "twin" on one daemon, same turn; `sid` then slept and released."""
    for name in (sid, "twin"):
        c.call("session.create", session_id=name, system=SYSTEM)
        chat(c, name, text)
    assert c.call("session.sleep", session_id=sid, release=True)["released"] is True


def wait_remote(c: RawClient, state: str = "ok", timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        remote = c.call("status")["remote"]
        if remote["state"] == state:
            return remote
        time.sleep(0.1)
    raise AssertionError(f"remote never became {state}: {remote}")


def test_a_session_slept_on_one_daemon_wakes_on_another_and_continues_identically(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "handover") as (ca, cb):
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


def test_a_held_session_is_refused_to_others_until_taken_over(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "held") as (ca, cb):
        ca.call("session.create", session_id="s", system=SYSTEM)
        chat(ca, "s", "hello")
        assert ca.call("session.sleep", session_id="s", remote_wait=True)["released"] is False
        with pytest.raises(RpcError) as busy:
            cb.call("session.wake", session_id="s")
        assert busy.value.code == "BUSY" and "take it over" in busy.value.message
        assert cb.call("snapshot.list")["snapshots"] == []  # nothing fetched for a refused wake
        woken = cb.call("session.wake", session_id="s", take_over=True)  # A is presumed dead
        assert woken["tokens"] > 0


def test_a_prompt_one_daemon_stored_is_reused_from_the_remote_by_another(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "prefix") as (ca, cb):
        ca.call("session.create", session_id="reader")
        cold = ca.call("session.append", session_id="reader", text=DOC)
        assert cold["reused"] == 0 and cold["tokens"] >= 1000
        expected = ca.call("session.generate", session_id="reader", max_tokens=8)["tokens"]
        ca.call("session.sleep", session_id="reader", remote_wait=True)

        cb.call("session.create", session_id="other-reader")  # B's first session with that prompt
        hit = cb.call("session.append", session_id="other-reader", text=DOC)
        assert hit["reused"] == (cold["tokens"] - 1) // 16 * 16 and hit["prefilled"] < 16
        assert cb.call("session.generate", session_id="other-reader", max_tokens=8)["tokens"] == expected
        assert cb.call("status")["remote"]["prefix_blocks"] == (cold["tokens"] - 1) // 16


def test_a_prompt_one_daemon_warmed_is_reused_whole_by_another_to_the_token(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "warm") as (ca, cb):
        ca.call("session.create", session_id="cold")  # A's cold prefill of the prompt: the reference
        cold = ca.call("session.append", session_id="cold", text=DOC)
        assert cold["reused"] == 0
        expected = ca.call("session.generate", session_id="cold", max_tokens=8)["tokens"]
        ca.call("session.delete", session_id="cold")
        warmed = ca.call("prefix.warm", text=DOC)
        assert warmed["tokens"] == cold["tokens"] and warmed["tokens"] % 16  # it ends in a short block
        deadline = time.monotonic() + 30
        while ca.call("status")["remote"]["uploaded_prefixes"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)

        cb.call("session.create", session_id="reader")  # B's first session with that prompt
        hit = cb.call("session.append", session_id="reader", text=DOC)
        assert (hit["reused"], hit["prefilled"]) == (cold["tokens"] - 1, 0)  # all but the pending last token
        assert cb.call("session.generate", session_id="reader", max_tokens=8)["tokens"] == expected
        remote = cb.call("status")["remote"]
        assert remote["prefix_blocks"] == warmed["blocks"] and remote["refused_objects"] == 0
        assert remote["prefix_partial_tokens"] == cold["tokens"] - 1 - warmed["blocks"] * 16


def test_wrong_keys_are_refused_and_local_service_goes_on(tmp_path, model_dir, weed):
    d = remote_daemon(tmp_path, model_dir, weed, "keys", AWS_SECRET_ACCESS_KEY="not-the-secret").start()
    with d.client() as c:
        remote = wait_remote(c, "unauthorized")
        assert "refused the credentials" in remote["error"] and "not-the-secret" not in str(remote)
        c.call("session.create", session_id="s", system=SYSTEM)
        first = chat(c, "s", "hello")["tokens"]
        with pytest.raises(RpcError) as refused:
            c.call("session.sleep", session_id="s", remote_wait=True)
        assert refused.value.code == "REMOTE_UNAVAILABLE" and "committed locally" in refused.value.message
        assert chat(c, "s", "again")["tokens"] and first  # the local snapshot wakes; service goes on
        with pytest.raises(RpcError) as missing:
            c.call("session.wake", session_id="elsewhere")
        assert missing.value.code == "REMOTE_UNAVAILABLE"
    assert d.stop() == 0


def test_a_corrupt_remote_block_is_refused_and_nothing_is_restored(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "corrupt") as (ca, cb):
        ca.call("session.create", session_id="s", system=SYSTEM)
        chat(ca, "s", "hello there, agent")
        ca.call("session.sleep", session_id="s", release=True)
        s3 = weed.store()
        import obstore

        blocks = [o["path"] for page in obstore.list(s3, "corrupt/") for o in page if "/blocks/" in o["path"]]
        data = bytearray(bytes(s3.get(blocks[0]).bytes()))
        data[-5] ^= 0x40  # one bit of the compressed payload
        s3.put(blocks[0], bytes(data))  # overwritten behind kvwake's back
        with pytest.raises(RpcError) as refused:
            chat(cb, "s", "continue")
        assert refused.value.code == "CORRUPT_BLOCK" and "refused" in refused.value.message
        assert cb.call("snapshot.list")["snapshots"] == []
        assert cb.call("status")["remote"]["refused_objects"] >= 1
        with pytest.raises(RpcError):  # refused again, never restored from the local store either
            cb.call("session.wake", session_id="s")


def test_server_killed_mid_upload_then_back_the_upload_finishes(tmp_path, model_dir):
    weed = Seaweed(tmp_path / "s3").start()
    try:
        with two_daemons(tmp_path, model_dir, weed, "cut") as (ca, cb):
            for sid in ("long", "twin"):
                ca.call("session.create", session_id=sid)
                ca.call("session.append", session_id=sid, text=DOC * 3)
            ca.call("session.sleep", session_id="long")  # its ~190 blocks start uploading...
            weed.kill()  # ...and the server dies under them
            assert wait_remote(ca, "down")["error"]
            expected = ca.call("session.generate", session_id="twin", max_tokens=8)["tokens"]  # local service goes on
            weed.start()
            wait_remote(ca), wait_remote(cb)
            ca.call("session.sleep", session_id="long", release=True)  # waits for the retried upload
            assert cb.call("session.generate", session_id="long", max_tokens=8)["tokens"] == expected
    finally:
        weed.kill()  # a SeaweedFS restarted under load takes its whole grace to stop: nothing here needs it
