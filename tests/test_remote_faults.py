"""The shared tier when things go wrong, against a real SeaweedFS: a slow server, an owner that was
taken over while still alive."""

from __future__ import annotations

import json
import time

import obstore
import pytest

from testkit.daemon import RpcError
from testkit.seaweed import SlowProxy
from tests.test_remote import DOC, SYSTEM, chat, remote_daemon, two_daemons, wait_remote, weed  # noqa: F401 (weed: the server)

DEADLINE_S = 2.0  # remote_prefix_deadline_s, the default


def test_a_slow_server_costs_an_append_the_lookup_deadline_then_it_prefills(tmp_path, model_dir, weed):
    a = remote_daemon(tmp_path / "a", model_dir, weed, "slow").start()
    proxy = SlowProxy(int(weed.endpoint.rsplit(":", 1)[1]))
    b = remote_daemon(tmp_path / "b", model_dir, weed, "slow", AWS_ENDPOINT_URL=proxy.endpoint).start()  # via it
    try:
        with a.client() as ca, b.client() as cb:
            wait_remote(ca), wait_remote(cb)
            ca.call("session.create", session_id="reader")
            began = time.monotonic()
            cold = ca.call("session.append", session_id="reader", text=DOC)
            cold_s = time.monotonic() - began
            ca.call("session.sleep", session_id="reader", remote_wait=True)  # the remote holds its blocks

            proxy.delay = 4.0  # every request now waits 4 s: past the lookup's deadline, within the 10 s timeout
            cb.call("session.create", session_id="other-reader")
            began = time.monotonic()
            slow = cb.call("session.append", session_id="other-reader", text=DOC)
            took = time.monotonic() - began
            assert slow["reused"] == 0 and slow["prefilled"] == cold["prefilled"]  # prefilled, nothing fetched
            assert DEADLINE_S <= took < DEADLINE_S + 2 * cold_s + 1.0, (took, cold_s)
            remote = cb.call("status")["remote"]
            assert remote["state"] == "slow" and "prefix lookup" in remote["error"]
            assert remote["prefix_lookups_late"] == 1 and remote["prefix_blocks"] == 0
            expected = ca.call("session.generate", session_id="reader", max_tokens=8)["tokens"]
            assert cb.call("session.generate", session_id="other-reader", max_tokens=8)["tokens"] == expected

            proxy.delay = 0.0
            time.sleep(4.5)  # the late requests answer (slowly: still "slow")
            cb.call("session.list")  # a quick answer: healthy again
            assert cb.call("status")["remote"]["state"] == "ok"
    finally:
        assert a.stop() == 0 and b.stop() == 0
        proxy.close()


def test_after_a_forced_takeover_the_old_owner_publishes_nothing_more(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "takeover") as (ca, cb):
        ca.call("session.create", session_id="s", system=SYSTEM)
        chat(ca, "s", "hello")
        ca.call("session.sleep", session_id="s", remote_wait=True)  # A holds the lease: epoch 1
        chat(ca, "s", "go on")  # A is alive and the session is hot there again
        cb.call("session.wake", session_id="s", take_over=True)  # B presumes A dead: epoch 2
        b_name = cb.call("status")["remote"]["daemon"]
        s3 = weed.store()
        manifests = lambda: [o["path"] for p in obstore.list(s3, "takeover/") for o in p if "/snapshots/" in o["path"]]  # noqa: E731
        before = manifests()

        with pytest.raises(RpcError) as lost:  # A's next snapshot stays local, and A is told why
            ca.call("session.sleep", session_id="s", remote_wait=True)
        assert lost.value.code == "BUSY" and "no longer holds its lease" in lost.value.message
        assert lost.value.data["owner"] == b_name and "stays local" in lost.value.message
        assert manifests() == before  # nothing of A's became the session's head
        assert ca.call("status")["remote"]["upload_failures"] == 1
        with pytest.raises(RpcError) as busy:  # nor may A wake it again while B holds it
            ca.call("session.wake", session_id="s")
        assert busy.value.code == "BUSY" and busy.value.data["owner"] == b_name

        after_b = chat(cb, "s", "and now?")["tokens"]  # B goes on from the state it took over
        cb.call("session.sleep", session_id="s", release=True)
        head = json.loads(bytes(s3.get(manifests()[-1]).bytes()))
        assert head["remote"] == {"epoch": 2, "daemon": b_name, "keep_history": 4}  # B's state is the head
        assert after_b and ca.call("session.wake", session_id="s")["snapshot_id"] == head["snapshot"]["id"]


def test_a_stop_right_after_a_sleep_finishes_the_upload_in_flight(tmp_path, model_dir, weed):
    """SIGTERM while the sleep's upload is under way: the stop finishes it (not only what is still queued),
    so another daemon can take the session over and continue it exactly."""
    proxy = SlowProxy(int(weed.endpoint.rsplit(":", 1)[1]))
    a = remote_daemon(tmp_path / "a", model_dir, weed, "stopped", AWS_ENDPOINT_URL=proxy.endpoint).start()
    try:
        with a.client() as ca:
            wait_remote(ca)
            for sid in ("agent", "twin"):
                ca.call("session.create", session_id=sid, system=SYSTEM)
                chat(ca, sid, "list the files")
            expected = ca.call("session.generate", session_id="twin", max_tokens=8)["tokens"]
            proxy.delay = 0.3  # every S3 request takes a while: the upload is surely in flight at the stop
            snapshot = ca.call("session.sleep", session_id="agent")["snapshot_id"]
            time.sleep(0.1)  # the uploader has taken it from the queue
            remote = ca.call("status")["remote"]
            queued, uploading = remote["queued"], remote["uploading"]
        began = time.monotonic()
        assert a.stop() == 0
        took = time.monotonic() - began
    finally:
        proxy.close()
    assert queued == 0 and uploading == snapshot, "the upload was not under way: this test would not test it"
    assert took < 30.0, took  # REMOTE_FLUSH_S bounds it
    assert a.log_problems() == []

    b = remote_daemon(tmp_path / "b", model_dir, weed, "stopped").start()
    with b.client() as cb:
        wait_remote(cb)
        woken = cb.call("session.wake", session_id="agent", take_over=True)  # A is gone: presumed dead
        assert woken["snapshot_id"] == snapshot
        assert cb.call("session.generate", session_id="agent", max_tokens=8)["tokens"] == expected
    assert b.stop() == 0
