"""Restore points on the shared tier, against a real SeaweedFS: pushed with the blocks they close, fetched
and verified on a hit (a damaged one refused, nothing kept), brought back with an adopted snapshot, kept by
the remote gc while a manifest names them; and a hybrid model's second conversation on another machine
restored through a point the first machine took."""

from __future__ import annotations

import json
import time

import numpy as np

from kvwake.daemon.model.engine import Engine
from kvwake.daemon.session_state import Session, common_prefix
from kvwake.store import Store
from kvwake.store.format.keys import chain_keys
from kvwake.store.remote.client import Remote
from kvwake.store.remote.gc import collect
from kvwake.store.remote.objects import RemoteConfig
from kvwake.store.remote.points import put_point
from kvwake.store.remote.shared_prompts import fetch_prefix
from kvwake.store.remote.snapshots import fetch_snapshot, upload_snapshot
from testkit.kvdata import BUNDLE, write_snapshot
from testkit.seaweed import BUCKET, KEY_ID, SECRET
from tests.test_engine_archs import folders  # noqa: F401 (fixture: tiny model folders, made once per module)
from tests.test_points_store import point_arrays
from tests.test_remote import weed  # noqa: F401 (the module's server)
from tests.test_restore_points import assert_as_cold, chat, plain_engine  # noqa: F401 (fixture)

B = 16
TOKENS = list(range(3000, 3000 + 3 * B + 5))  # three full blocks and a tail


def _store(path) -> Store:
    store = Store(path, block_tokens=B)
    store.register_bundle(BUNDLE, {"test": True})
    return store


def _remote(weed, prefix: str, daemon: str, bundle: str = BUNDLE) -> Remote:
    remote = Remote(RemoteConfig(f"s3://{BUCKET}/{prefix}", weed.endpoint, KEY_ID, SECRET, timeout_s=5.0), bundle, daemon)
    remote.connect(B, {"test": True})
    return remote


def _published(store: Store, remote: Remote, session_id: str = "s") -> str:
    """A snapshot of TOKENS with a point closing its third block, uploaded; returns the point's key."""
    info = write_snapshot(store, session_id, TOKENS)
    key = chain_keys(BUNDLE, TOKENS, B)[2]
    assert store.write_point(BUNDLE, key, 3 * B, point_arrays(3))
    upload_snapshot(remote, store, info.id, remote.acquire(session_id))
    return key


def damage(weed, path: str) -> bytes:
    """One bit of the object at `path` (under the bucket) flipped, behind kvwake's back; returns its bytes."""
    s3 = weed.store()
    data = bytearray(bytes(s3.get(path).bytes()))
    data[-5] ^= 0x40
    s3.put(path, bytes(data))
    return bytes(data)


def _assert_same_point(got: Store, want: Store, key: str) -> None:
    a = got.read_point(got.point_refs([key], BUNDLE)[key])
    b = want.read_point(want.point_refs([key], BUNDLE)[key])
    assert a.keys() == b.keys() and all(np.array_equal(a[n].array, b[n].array) for n in a)


def test_a_point_goes_up_with_its_snapshot_and_serves_a_hit_on_another_machine(tmp_path, weed):
    a, b, c = _store(tmp_path / "a"), _store(tmp_path / "b"), _store(tmp_path / "c")
    ra, rb, rc = _remote(weed, "points", "d-a"), _remote(weed, "points", "d-b"), _remote(weed, "points", "d-c")
    key = _published(a, ra)
    assert ra.counters["uploaded_points"] == 1
    manifest = json.loads(rb.get(rb.head("s")))
    assert [p["key"] for p in manifest["points"]] == [key] and manifest["points"][0]["n_tokens"] == 3 * B
    assert fetch_prefix(rb, b, TOKENS[:-1], deadline_s=5.0, with_points=True) == (3, 0)
    _assert_same_point(b, a, key)  # verified on the way, the very arrays A stored
    assert fetch_prefix(rb, b, TOKENS[:-1], deadline_s=5.0, with_points=True) == (0, 0)
    assert rb.counters["fetched_points"] == 1  # held locally now: not asked again
    adopted = fetch_snapshot(rc, c, rc.head("s"), "s")  # an adopted conversation brings its points
    assert adopted["points"] == 1
    _assert_same_point(c, a, key)
    for r in (ra, rb, rc):
        r.close()


def test_a_damaged_point_object_is_refused_and_nothing_kept(tmp_path, weed):
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    ra, rb = _remote(weed, "points-bad", "d-a"), _remote(weed, "points-bad", "d-b")
    key = _published(a, ra)
    damage(weed, "points-bad/" + ra.point_key(key))
    assert fetch_prefix(rb, b, TOKENS[:-1], deadline_s=5.0, with_points=True) == (3, 0)  # the blocks serve
    assert b.point_refs([key], BUNDLE) == {} and rb.counters["refused_objects"] == 1
    for r in (ra, rb):
        r.close()


def test_the_remote_gc_keeps_named_points_removes_others_and_repairs_a_damaged_one(tmp_path, weed):
    a = _store(tmp_path / "a")
    ra = _remote(weed, "points-gc", "d-a")
    key = _published(a, ra)
    stray = chain_keys(BUNDLE, TOKENS, B)[0]  # a point no manifest names: an upload cut off before its manifest
    a.write_point(BUNDLE, stray, B, point_arrays(1))
    assert put_point(ra, a, a.point_refs([stray], BUNDLE)[stray])
    young = collect(ra, a, grace_s=3600)
    assert (young.points, young.removed_points, young.kept_young) == (2, 0, 1)
    time.sleep(1.2)
    report = collect(ra, a, grace_s=1)
    assert report.removed_points == 1 and ra.exists(ra.point_key(key)) and not ra.exists(ra.point_key(stray))
    damaged = damage(weed, "points-gc/" + ra.point_key(key))
    repaired = collect(ra, a, grace_s=3600, verify=True)
    assert (repaired.corrupt_removed, repaired.repaired) == (1, 1)
    assert bytes(weed.store().get("points-gc/" + ra.point_key(key)).bytes()) != damaged  # A's verified copy
    assert collect(ra, a, grace_s=3600, verify=True).corrupt_removed == 0
    ra.close()


def test_a_hybrid_models_second_conversation_on_another_machine_restores_through_the_remote_point(
        tmp_path, weed, folders, plain_engine):
    engines = [Engine(Store(tmp_path / name, block_tokens=B), tmp_path, folders("gemma3_text")) for name in "ab"]
    a, b = engines
    ra, rb = (_remote(weed, "points-engine", d, a.bundle.hash) for d in ("d-a", "d-b"))
    try:
        first = Session("first")
        a.append(first, messages=chat("a"))
        held = list(first.tokens)
        upload_snapshot(ra, a.store, a.sleep(first)["snapshot_id"], ra.acquire("first"))
        second = Session("second")
        plan = b.plan(second, messages=chat("Pick one tool and say why."))
        assert fetch_prefix(rb, b.store, plan.target[:-1], deadline_s=5.0, with_points=True)[0] > 0
        shared = common_prefix(held, plan.target)
        keys = chain_keys(a.bundle.hash, held, B)
        taken = [(i + 1) * B for i, k in enumerate(keys) if k in a.store.point_refs(keys, a.bundle.hash)]
        deepest = max(w for w in taken if w <= shared)
        got = b.append(second, messages=chat("Pick one tool and say why."))
        assert got["reused"] == deepest >= shared * 0.8 and b.counters["tokens_from_points"] == deepest
        assert_as_cold(b, plain_engine("gemma3_text"), second, "gemma3_text")
    finally:
        for r in (ra, rb):
            r.close()
        for engine in engines:
            engine.close()
            engine.store.close()


async def test_a_cold_append_of_a_hybrid_model_asks_the_remote_for_blocks_and_points(tmp_path, weed, folders):
    # The append path of a model served through restore points (a stored prefix only) asked the remote for
    # nothing: a daemon sharing the remote prefilled the whole system prompt another daemon had published.
    import anyio

    from kvwake.daemon.config import Settings
    from kvwake.daemon.model.provider import ModelProvider
    from kvwake.daemon.model.thread import EngineThread
    from kvwake.daemon.sessions.manager import SessionManager
    from kvwake.daemon.sessions.remote_tier import RemoteTier

    managers, threads = [], []
    for name in ("a", "b"):
        settings = Settings(socket=tmp_path / f"{name}.sock", data_dir=tmp_path / name, block_tokens=B,
                            remote=f"s3://{BUCKET}/points-tier", remote_endpoint=weed.endpoint,
                            remote_access_key_id=KEY_ID, remote_secret_access_key=SECRET)
        store, thread = Store(settings.store_dir, block_tokens=B), EngineThread()
        engine = thread.submit(lambda: Engine(store, settings.data_dir, folders("gemma3_text"))).result()
        managers.append(SessionManager(ModelProvider.of(engine, thread), settings))
        managers[-1].remote = RemoteTier(settings, engine)
        threads.append(thread)
    a, b = managers
    try:
        async with anyio.create_task_group() as tg:
            for m in managers:
                tg.start_soon(m.remote.run)
            with anyio.fail_after(30):
                for m in managers:
                    await m.remote.ready.wait()
            await a.create("first")
            await a.append("first", messages=chat("a"))
            await a.sleep("first", remote_wait=True)
            await b.create("second")
            got = await b.append("second", messages=chat("Pick one tool and say why."))
            assert got["reused"] >= B and b.remote.remote.counters["fetched_points"] >= 1
            assert b.engine.counters["tokens_from_points"] == got["reused"]
            tg.cancel_scope.cancel()
    finally:
        for m, thread in zip(managers, threads):
            m.remote.close()
            thread.stop()
            m.engine.close()
            m.store.close()
