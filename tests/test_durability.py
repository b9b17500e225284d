"""kill -9 at random points, and two processes writing one store, leave it consistent."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

from kvwake.store import Store
from kvwake.store.files import TEMP_SUFFIX
from tests.kvdata import assert_snapshot_exact

REPO = Path(__file__).resolve().parent.parent
KILLS = 50


def writer(root: Path, seed: int, count: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.store_writer", str(root), str(seed), str(count)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def visible(store: Store) -> dict[str, str]:
    return {s["id"]: s["digest"] for s in store.snapshots() if not s["session_id"].startswith("scratch")}


def test_kill_9_at_random_points_never_loses_a_committed_snapshot(tmp_path):
    root, rng = tmp_path / "store", random.Random(2026)
    previous: dict[str, str] = {}
    verified: set[str] = set()
    orphans_seen = 0
    for round_ in range(KILLS):
        proc = writer(root, round_, -1)
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.12))
        proc.kill()
        proc.communicate()
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
