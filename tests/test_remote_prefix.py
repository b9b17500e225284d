"""Token-granular prefix reuse across machines, at the store layer, against a real SeaweedFS: a warmed
prompt's short last block serves its first k tokens from the remote, verified like any remote read;
a session's tail never does."""

from __future__ import annotations

import obstore
import pytest

from kvwake.errors import CorruptBlockError
from kvwake.store import Store
from kvwake.store.format.keys import chain_keys
from kvwake.store.remote.shared_prompts import fetch_prefix, upload_prefix
from kvwake.store.remote.snapshots import upload_snapshot
from testkit.kvdata import BUNDLE, kv_arrays, write_snapshot
from tests.test_remote import weed  # noqa: F401 (the module's server)
from tests.test_remote_gc import _remote

B = 16
PROMPT = list(range(2000, 2000 + 3 * B + 11))  # three full blocks and a short one of 11 tokens


def _store(path) -> Store:
    store = Store(path, block_tokens=B)
    store.register_bundle(BUNDLE, {"test": True})
    return store


def _warm(store: Store, tokens: list[int]) -> None:
    """What prefix.warm stores: every full block, and the last partial block as a short block."""
    with store.writer(None, BUNDLE, tokens, pin=True, partial=True) as w:
        for i in w.needed:
            w.add_block(i, kv_arrays(w.block_tokens(i), i * B))
        w.commit()


def test_a_warmed_prompts_short_block_serves_its_first_k_tokens_from_the_remote(tmp_path, weed):
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    _warm(a, PROMPT)
    ra, rb = _remote(weed, "short", "d-a"), _remote(weed, "short", "d-b")
    sent = upload_prefix(ra, a, PROMPT)
    assert (sent["blocks"], sent["new_blocks"]) == (4, 4)
    request = PROMPT[:-2] + [7, 8, 9]  # shares 9 of the short block's 11 tokens, then goes its own way
    assert fetch_prefix(rb, b, request, deadline_s=5.0, min_partial=4) == (3, 9)
    hit = b.prefix_hit(BUNDLE, request, min_partial=4)
    assert len(hit.blocks) == 3 and hit.partial is not None and hit.partial.tokens == 9
    short = chain_keys(BUNDLE, PROMPT, B, partial=True)[-1]
    assert hit.partial.block.key == short
    got = b.read_block(hit.partial.block)
    want = kv_arrays(PROMPT[3 * B :], 3 * B)
    assert all((got[name].array == want[name].array).all() for name in want)  # the very bytes A stored
    assert fetch_prefix(rb, b, request, deadline_s=5.0, min_partial=4) == (0, 0)  # held locally now: no refetch
    for r in (ra, rb):
        r.close()


def test_a_corrupt_short_block_is_refused_and_nothing_is_kept(tmp_path, weed):
    a, c = _store(tmp_path / "a"), _store(tmp_path / "c")
    _warm(a, PROMPT)
    ra, rc = _remote(weed, "short-bad", "d-a"), _remote(weed, "short-bad", "d-c")
    upload_prefix(ra, a, PROMPT)
    s3, short = weed.store(), chain_keys(BUNDLE, PROMPT, B, partial=True)[-1]
    path = next(o["path"] for page in obstore.list(s3, "short-bad/") for o in page if o["path"].endswith(short))
    data = bytearray(bytes(s3.get(path).bytes()))
    data[-5] ^= 0x40
    s3.put(path, bytes(data))  # one bit, behind kvwake's back
    with pytest.raises(CorruptBlockError, match="refused"):
        fetch_prefix(rc, c, PROMPT[:-1], deadline_s=5.0, min_partial=4)
    hit = c.prefix_hit(BUNDLE, PROMPT[:-1], min_partial=4)
    assert len(hit.blocks) == 3 and hit.partial is None and rc.counters["refused_objects"] == 1
    for r in (ra, rc):
        r.close()


def test_a_sessions_tail_does_not_serve_other_machines(tmp_path, weed):
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    info = write_snapshot(a, "private", PROMPT)  # its last 11 tokens are in its tail
    ra, rb = _remote(weed, "tails", "d-a"), _remote(weed, "tails", "d-b")
    upload_snapshot(ra, a, info.id, ra.acquire("private"))
    assert fetch_prefix(rb, b, PROMPT[:-1], deadline_s=5.0, min_partial=4) == (3, 0)  # whole blocks only
    assert b.prefix_hit(BUNDLE, PROMPT[:-1], min_partial=4).partial is None
    for r in (ra, rb):
        r.close()


def test_a_fetch_that_raises_is_logged_not_passed_off_as_missing(tmp_path, weed, monkeypatch, caplog):
    # Was: any exception in a block fetch (a code bug included) ended the lookup silently, as if the
    # remote had no such block: the only sign was less reuse.
    from kvwake.store.remote import shared_prompts as remote_prefix

    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    _warm(a, PROMPT)
    ra, rb = _remote(weed, "raises", "d-a"), _remote(weed, "raises", "d-b")
    upload_prefix(ra, a, PROMPT)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the fetch")

    monkeypatch.setattr(remote_prefix, "fetch_block", broken)
    with caplog.at_level("WARNING", logger="kvwake.remote"):
        assert fetch_prefix(rb, b, PROMPT[:-1], deadline_s=5.0, min_partial=4) == (0, 0)
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "raised" in record.getMessage() and "a bug in the fetch" in str(record.exc_info[1])
    for r in (ra, rb):
        r.close()


async def test_a_cold_append_beside_a_remote_takes_one_worker_thread(tmp_path, weed):
    # A remote prefix lookup that awaits a second anyio worker thread from inside the append's own hangs the
    # daemon once as many cold appends run at once as the pool has threads (40). With the pool cut to one
    # thread, one cold append is enough to show it.
    import anyio
    from anyio import to_thread

    from kvwake.daemon.config import Settings
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.thread import EngineThread
    from kvwake.daemon.model.provider import ModelProvider
    from kvwake.daemon.sessions.manager import SessionManager
    from kvwake.daemon.sessions.remote_tier import RemoteTier
    from testkit.seaweed import BUCKET, KEY_ID, SECRET
    from testkit.tinymodel import make_model_dir

    settings = Settings(socket=tmp_path / "s.sock", data_dir=tmp_path, block_tokens=B, remote=f"s3://{BUCKET}/threads",
                        remote_endpoint=weed.endpoint, remote_access_key_id=KEY_ID, remote_secret_access_key=SECRET)
    store, thread = Store(settings.store_dir, block_tokens=B), EngineThread()
    engine = thread.submit(lambda: Engine(store, tmp_path, make_model_dir(tmp_path / "model"))).result()
    manager = SessionManager(ModelProvider.of(engine, thread), settings)
    manager.remote = RemoteTier(settings, engine)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(manager.remote.run)
            with anyio.fail_after(30):
                await manager.remote.ready.wait()
            to_thread.current_default_thread_limiter().total_tokens = 1
            await manager.create("cold")
            with anyio.fail_after(30):
                appended = await manager.append("cold", text="A prompt the remote is asked for first. " * 3)
            assert appended["prefilled"] == appended["tokens"] - 1
            assert manager.remote.healthy and manager.remote.counters["prefix_lookups_late"] == 0
            tg.cancel_scope.cancel()
    finally:
        manager.remote.close()
        thread.stop()
        engine.close()
        store.close()


async def test_the_remote_state_is_connecting_until_remote_reads_work(tmp_path, weed):
    # Was: status said "ok" as soon as the identity check's first request answered, before the tier was
    # ready, and a wake with take_over sent in that window got REMOTE_UNAVAILABLE "still connecting"
    # (seen in test_remote_faults under load). The window is held open here by a connect that waits.
    import threading

    import anyio

    from kvwake.daemon.config import Settings
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.thread import EngineThread
    from kvwake.daemon.sessions.remote_tier import RemoteTier
    from kvwake.errors import RemoteUnavailableError
    from testkit.seaweed import BUCKET, KEY_ID, SECRET
    from testkit.tinymodel import make_model_dir

    settings = Settings(socket=tmp_path / "s.sock", data_dir=tmp_path, block_tokens=B, remote=f"s3://{BUCKET}/window",
                        remote_endpoint=weed.endpoint, remote_access_key_id=KEY_ID, remote_secret_access_key=SECRET)
    store, thread = Store(settings.store_dir, block_tokens=B), EngineThread()
    engine = thread.submit(lambda: Engine(store, tmp_path, make_model_dir(tmp_path / "model"))).result()
    tier = RemoteTier(settings, engine)
    connect, answered, go_on = tier.remote.connect, threading.Event(), threading.Event()

    def slow_connect(*args):
        connect(*args)  # the identity check answers: health "ok"
        answered.set()
        go_on.wait(30)

    tier.remote.connect = slow_connect
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.run)
            with anyio.fail_after(30):
                while not answered.is_set():
                    await anyio.sleep(0.01)
            assert tier.remote.health.state == "ok" and tier.status()["state"] == "connecting"
            with pytest.raises(RemoteUnavailableError, match="still connecting"):
                await tier.adopt("anyone", take_over=True)
            go_on.set()
            with anyio.fail_after(30):
                await tier.ready.wait()
            assert tier.status()["state"] == "ok"
            tg.cancel_scope.cancel()
    finally:
        go_on.set()
        tier.close()
        thread.stop()
        engine.close()
        store.close()
