"""The remote gc and shared prefixes against a real SeaweedFS: what a manifest names survives, the rest
goes after its grace period, damaged objects are replaced, and a gc racing an upload never leaves a
manifest naming a removed object."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import obstore
import pytest

from kvwake.store import Store
from kvwake.store.remote.client import Remote
from kvwake.store.remote.objects import RemoteConfig
from kvwake.store.remote.gc import collect
from kvwake.store.remote.snapshots import fetch_snapshot, upload_blocks, upload_snapshot
from testkit.daemon import RpcError
from testkit.kvdata import BUNDLE, assert_snapshot_exact, write_snapshot
from testkit.seaweed import BUCKET, KEY_ID, SECRET
from tests.test_remote import (DOC, chat, released_with_twin, remote_daemon, two_daemons, wait_remote,  # noqa: F401
                               weed)  # weed: the module's server


def objects(weed, prefix: str) -> dict[str, bytes]:
    s3 = weed.store()
    return {o["path"]: bytes(s3.get(o["path"]).bytes()) for page in obstore.list(s3, prefix) for o in page}


def wait_status(c, key: str, at_least: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while (remote := c.call("status")["remote"])[key] < at_least:
        assert time.monotonic() < deadline, f"status.remote.{key} stayed below {at_least}: {remote}"
        time.sleep(0.1)
    return remote


def test_gc_removes_only_old_objects_no_manifest_names(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "gc") as (ca, cb):
        released_with_twin(ca, "agent", "list the files")
        warmed = ca.call("prefix.warm", text=DOC)  # a shared prompt: kept by its prefix manifest
        wait_status(ca, "uploaded_prefixes", 1)
        published = objects(weed, "gc/")
        block = next(p for p in published if "/blocks/" in p)
        ns = block.split("/blocks/")[0]
        s3 = weed.store()  # an upload cut off before its manifest: a block and a tail no manifest names
        s3.put(f"{ns}/blocks/{'0' * 64}", published[block])
        s3.put(f"{ns}/tails/cut-off-snapshot", b"tail bytes")

        young = ca.call("store.gc", remote=True)["remote"]  # default grace: an hour
        assert young["removed_blocks"] == young["removed_tails"] == 0 and young["kept_young"] == 2
        time.sleep(1.5)
        report = ca.call("store.gc", remote=True, grace_s=1)["remote"]
        assert (report["removed_blocks"], report["removed_tails"], report["prefixes"]) == (1, 1, 1)
        assert report["manifests"] >= 1 and not report["incomplete"]
        left = objects(weed, "gc/")
        assert {p: d for p, d in published.items()} == {p: d for p, d in left.items() if p in published}
        assert not [p for p in left if p not in published and "/gc/" not in p]  # the two leftovers went

        expected = chat(ca, "twin", "now open one")["tokens"]
        assert chat(cb, "agent", "now open one")["tokens"] == expected  # B wakes A's session exactly
        cb.call("session.create", session_id="reader")  # B reuses A's warmed prompt from the remote
        hit = cb.call("session.append", session_id="reader", text=DOC)
        assert (hit["reused"], hit["prefilled"]) == (warmed["tokens"] - 1, 0)  # its short last block too
        assert cb.call("status")["remote"]["prefix_blocks"] == warmed["blocks"]
        with pytest.raises(RpcError) as refused:  # the remote gc is for daemons serving with --remote only
            ca.call("store.gc", grace_s=5)
        assert refused.value.code == "INVALID_PARAMS"


def test_gc_verify_removes_a_damaged_block_and_the_daemon_holding_it_puts_it_back(tmp_path, model_dir, weed):
    with two_daemons(tmp_path, model_dir, weed, "repair") as (ca, cb):
        released_with_twin(ca, "s", "hello there, agent")
        s3 = weed.store()
        key = next(p for p in objects(weed, "repair/") if "/blocks/" in p)
        good = bytes(s3.get(key).bytes())
        s3.put(key, good[:-5] + bytes([good[-5] ^ 0x40]) + good[-4:])  # one bit, behind kvwake's back

        on_b = cb.call("store.gc", remote=True, verify=True)["remote"]  # B has no copy: removed, not repaired
        assert (on_b["corrupt_removed"], on_b["repaired"]) == (1, 0) and on_b["verified"] >= 2
        with pytest.raises(RpcError) as missing:  # nothing corrupt is restored; a missing block is refused
            cb.call("session.wake", session_id="s")
        assert missing.value.code == "CORRUPT_BLOCK" and "missing" in missing.value.message
        on_a = ca.call("store.gc", remote=True, verify=True)["remote"]  # A holds it: put back, verified
        assert (on_a["missing"], on_a["repaired"], on_a["corrupt_removed"]) == (1, 1, 0)
        assert bytes(s3.get(key).bytes()) == good
        expected = chat(ca, "twin", "continue")["tokens"]
        assert chat(cb, "s", "continue")["tokens"] == expected


# -- the race between a gc and an upload that reuses an unreferenced block --------------------------


def _remote(weed, prefix: str, daemon: str) -> Remote:
    config = RemoteConfig(f"s3://{BUCKET}/{prefix}", weed.endpoint, KEY_ID, SECRET, timeout_s=5.0)
    remote = Remote(config, BUNDLE, daemon)
    remote.connect(16, {"test": True})
    return remote


@pytest.mark.parametrize("when", ["between its existence checks and its puts", "right before its manifest"])
def test_a_gc_racing_an_upload_never_leaves_a_manifest_naming_a_removed_block(tmp_path, weed, when):
    prefix = "race-" + when.split()[0]
    store = Store(tmp_path / "a", block_tokens=16)
    store.register_bundle(BUNDLE, {"test": True})
    tokens = list(range(1000, 1000 + 16 * 6 + 5))
    info = write_snapshot(store, "s", tokens)
    uploader, gc = _remote(weed, prefix, "d-uploader"), _remote(weed, prefix, "d-gc")
    upload_blocks(uploader, store, list(store.snapshot(info.id).blocks))  # a cut-off upload: no manifest
    time.sleep(1.5)  # older than grace_s=0 by the server's clock (last-modified has 1 s resolution)
    lease = uploader.acquire("s")
    ran: list = []
    once = threading.Lock()

    def gc_now() -> None:  # the other daemon's gc, for real, at the worst moment
        if once.acquire(blocking=False):
            ran.append(collect(gc, None, grace_s=0))

    if when.startswith("between"):
        exists = uploader.exists
        uploader.exists = lambda key: (exists(key), "/blocks/" in key and gc_now())[0]  # "present", then removed
    else:
        current = uploader.current_lease
        uploader.current_lease = lambda sid: (gc_now(), current(sid))[1]
    upload_snapshot(uploader, store, info.id, lease)
    assert ran and ran[0].removed_blocks >= 1  # the gc did remove reused blocks mid-upload

    fresh = Store(tmp_path / "b", block_tokens=16)
    fresh.register_bundle(BUNDLE, {"test": True})
    reader = _remote(weed, prefix, "d-reader")
    fetch_snapshot(reader, fresh, reader.head("s"), "s")  # every object the manifest names is there, intact
    assert_snapshot_exact(fresh, info.id)
    for r in (uploader, gc, reader):
        r.close()


def test_the_gc_remote_command_collects_through_a_real_daemon(tmp_path, model_dir, weed):
    d = remote_daemon(tmp_path / "a", model_dir, weed, "cli").start()
    with d.client() as c:
        wait_remote(c)
        released_with_twin(c, "agent", "list the files")
        named = objects(weed, "cli/")
        ns = next(p for p in named if "/blocks/" in p).split("/blocks/")[0]
        weed.store().put(f"{ns}/blocks/{'0' * 64}", b"left by an upload cut off before its manifest")
        time.sleep(1.5)  # older than --grace 1 by the server's clock (1 s resolution)

        def kvwake(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "kvwake.client.cli", "--socket", str(d.socket), *args],
                                  capture_output=True, text=True, timeout=120)

        shown = kvwake("gc", "--remote", "--grace", "1", "--verify", "--json")
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        assert (report["removed_blocks"], report["corrupt_removed"], report["incomplete"]) == (1, 0, False)
        assert report["manifests"] >= 1 and report["verified"] >= 2
        after = objects(weed, "cli/")
        assert named.keys() <= after.keys() and {k for k in after if k not in named} == {k for k in after if "/gc/" in k}
        human = kvwake("gc", "--remote")  # the default grace (an hour): nothing is old enough now
        assert human.returncode == 0 and "removed_blocks" in human.stdout and "epoch" in human.stdout
        misuse = kvwake("gc", "--verify")
        assert misuse.returncode == 2 and "--grace and --verify go with --remote" in misuse.stderr
    assert d.stop() == 0


def test_history_pruning_keeps_the_head_checkpoints_and_what_the_head_names(tmp_path, weed):
    store = Store(tmp_path / "a", block_tokens=16)
    store.register_bundle(BUNDLE, {"test": True})
    owner, other = _remote(weed, "history", "d-owner"), _remote(weed, "history", "d-other")
    owner.keep_history = 1  # the owner's setting; the gc below runs on a daemon configured otherwise
    other.keep_history = 10
    lease, base = owner.acquire("s"), list(range(3000, 3000 + 16 * 3))
    ids = []
    for n, label in ((3, None), (5, "checkpoint"), (7, None), (9, None), (11, None)):  # each one sleep
        ids.append(write_snapshot(store, "s", base + list(range(n)), label=label).id)
        upload_snapshot(owner, store, ids[-1], lease)
    upload_snapshot(owner, store, write_snapshot(store, "older", base + [1]).id, owner.acquire("older"))
    owner.keep_history = None  # a daemon from before this rule publishes the head: it names no keep_history
    upload_snapshot(owner, store, write_snapshot(store, "older", base + [1, 2]).id, owner.acquire("older"))
    time.sleep(1.5)  # older than grace_s=0 by the server's clock

    report = collect(other, None, grace_s=0)
    assert (report.pruned_manifests, report.removed_tails, report.removed_blocks) == (2, 2, 0)
    left = {p.rsplit("-", 1)[-1].removesuffix(".json") for p in objects(weed, "history/") if "/snapshots/s/" in p}
    assert left == {ids[1], ids[3], ids[4]}  # the checkpoint, the newest other, the head
    assert sum("/snapshots/older/" in p for p in objects(weed, "history/")) == 2  # its head names none: all stay
    fresh = Store(tmp_path / "b", block_tokens=16)
    fresh.register_bundle(BUNDLE, {"test": True})
    for sid in ids[1], ids[3], ids[4]:  # every kept manifest still has all its objects
        key = next(p for p in objects(weed, "history/") if p.endswith(f"-{sid}.json"))
        fetch_snapshot(other, fresh, key.removeprefix("history/"), "s")
        assert_snapshot_exact(fresh, sid)
    assert collect(other, None, grace_s=0).pruned_manifests == 0  # nothing more to prune
    for r in (owner, other):
        r.close()
