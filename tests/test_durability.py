"""kill -9 at random points, and two processes writing one store, leave it consistent; syncs reach the disk
(F_FULLFSYNC on macOS, faked here)."""

from __future__ import annotations

import errno
import multiprocessing
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

from kvwake.store import Store
from kvwake.store.files import TEMP_SUFFIX, write_durable
from tests.helpers import store_writer
from testkit.kvdata import BUNDLE, assert_snapshot_exact, write_snapshot

REPO = Path(__file__).resolve().parent.parent
KILLS = 36
# Killed writers are forked from one warm process, the store's modules already imported: each round's
# writer is ready at once, not after a fresh interpreter's imports.
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload([store_writer.__name__])


def writer(root: Path, seed: int, count: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.store_writer", str(root), str(seed), str(count)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def forked_writer(root: Path, seed: int) -> multiprocessing.Process:
    """A writer writing until killed, started from the warm forkserver; returns once its store is open."""
    ours, theirs = FORKS.Pipe(duplex=False)
    proc = FORKS.Process(target=store_writer.write_until_killed, args=(str(root), seed, theirs), daemon=True)
    proc.start()
    theirs.close()
    with ours:
        assert ours.poll(60) and ours.recv() == "ready", f"writer {seed} exited {proc.exitcode} before it was ready"
    return proc


def visible(store: Store) -> dict[str, str]:
    return {s["id"]: s["digest"] for s in store.snapshots() if not s["session_id"].startswith("scratch")}


def test_kill_9_at_random_points_never_loses_a_committed_snapshot(tmp_path):
    root, rng = tmp_path / "store", random.Random(2026)
    previous: dict[str, str] = {}
    verified: set[str] = set()
    orphans_seen = 0
    for round_ in range(KILLS):
        proc = forked_writer(root, round_)
        time.sleep(rng.uniform(0.0, 0.12))
        proc.kill()
        proc.join()
        assert proc.exitcode == -9
        with Store(root, block_tokens=4, keep_history=1000) as store:
            now = visible(store)
            lost = {k: v for k, v in previous.items() if now.get(k) != v}
            assert not lost, f"round {round_}: snapshots lost or changed after kill -9: {lost}"
            for snapshot_id in now.keys() - verified:  # every snapshot is read back once, fully
                assert_snapshot_exact(store, snapshot_id)
            verified |= now.keys()
            for snapshot_id in previous:  # and earlier ones still verify (digest, chain, files)
                store.snapshot(snapshot_id)
            orphans_seen += store.gc(keep_history=1000).orphans_removed
            assert not [p for p in store.files.walk() if p.name.endswith(TEMP_SUFFIX)]
            report = store.fsck()
            assert report.ok and not report.orphans, f"round {round_}: {report}"
            previous = now
    assert len(verified) > KILLS  # the writer got work done between kills
    assert orphans_seen > 0  # and some kills landed between a file write and its commit


def test_two_processes_writing_one_store_leave_it_consistent(tmp_path):
    root = tmp_path / "store"
    Store(root, block_tokens=4).close()
    procs = [writer(root, seed, 30) for seed in (1, 2)]
    written = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        written += out.split()[1:]
    with Store(root, block_tokens=4) as store:
        assert len(written) == 60 and set(written) <= set(visible(store))
        for snapshot_id in written:
            assert_snapshot_exact(store, snapshot_id)
        report = store.fsck()
        assert report.ok and not report.orphans, report


class FullSyncs:
    """A fake macOS: `sys.platform` "darwin" and an `F_FULLFSYNC` that is recorded (as file or directory),
    then done as an fsync; plain fsyncs are recorded apart (on macOS they would not reach the disk)."""

    F_FULLFSYNC = 51  # macOS's value

    def __init__(self, monkeypatch, refuse: int | None = None) -> None:
        import fcntl
        import os

        self.full: list[str] = []
        self.plain: list[str] = []
        self.refuse = refuse
        fsync, fcntl_ = os.fsync, fcntl.fcntl

        def kind(fd: int) -> str:
            return "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"

        def fake_fcntl(fd, cmd, *args):
            if cmd != self.F_FULLFSYNC:
                return fcntl_(fd, cmd, *args)
            if self.refuse is not None:
                raise OSError(self.refuse, os.strerror(self.refuse))
            self.full.append(kind(fd))
            fsync(fd)
            return 0

        def fake_fsync(fd):
            self.plain.append(kind(fd))
            fsync(fd)

        monkeypatch.setattr(sys, "platform", "darwin")
        monkeypatch.setattr(fcntl, "F_FULLFSYNC", self.F_FULLFSYNC, raising=False)
        monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
        monkeypatch.setattr(os, "fsync", fake_fsync)


def test_on_macos_files_directories_and_the_index_are_synced_with_full_fsync(tmp_path, monkeypatch):
    syncs = FullSyncs(monkeypatch)
    store = Store(tmp_path / "store", block_tokens=4)
    store.register_bundle(BUNDLE, {"model": "test-a"})
    info = write_snapshot(store, "s1", list(range(100, 114)))  # 3 blocks and a tail
    store.export(info.id, tmp_path / "s1.kvwake")
    pragmas = {p: store.rows(f"PRAGMA {p}")[0][p] for p in ("fullfsync", "checkpoint_fullfsync", "synchronous")}
    store.close()

    assert syncs.plain == []  # no sync stopped at the drive's cache
    assert syncs.full.count("file") >= 5 and syncs.full.count("dir") >= 2, syncs.full  # 3 blocks, tail, export
    assert pragmas == {"fullfsync": 1, "checkpoint_fullfsync": 1, "synchronous": 2}


def test_on_a_file_system_without_full_fsync_the_sync_is_an_fsync_and_says_so(tmp_path, monkeypatch, caplog):
    syncs = FullSyncs(monkeypatch, refuse=errno.ENOTSUP)
    monkeypatch.setattr("kvwake.store.files._refused_fullfsync", set())
    with caplog.at_level("WARNING", logger="kvwake.store"):
        write_durable(tmp_path / "f", b"data")
        write_durable(tmp_path / "g", b"more")
    assert syncs.full == [] and syncs.plain == ["file", "dir", "file", "dir"]
    assert (tmp_path / "f").read_bytes() == b"data"
    assert [r.getMessage() for r in caplog.records] == [  # once per device
        "this file system refuses F_FULLFSYNC: its writes are synced with fsync only, which a power loss may undo"]


def test_elsewhere_the_sync_is_an_fsync_and_sqlite_keeps_its_default(tmp_path, monkeypatch):
    syncs = FullSyncs(monkeypatch)
    monkeypatch.setattr(sys, "platform", "linux")
    store = Store(tmp_path / "store", block_tokens=4)
    store.register_bundle(BUNDLE, {"model": "test-a"})
    write_snapshot(store, "s1", list(range(100, 114)))
    assert store.rows("PRAGMA fullfsync")[0]["fullfsync"] == 0
    store.close()
    assert syncs.full == [] and "file" in syncs.plain and "dir" in syncs.plain
