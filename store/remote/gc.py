"""The remote gc: the only code that deletes objects from the shared tier (`kvwake gc --remote`).

What it removes, in one bundle's namespace:
- block, tail and restore point objects that no manifest names (snapshot
  manifests under `snapshots/`, prefix manifests under `prefixes/`), once
  their last-modified time is older than `grace_s`: the leftovers of uploads
  cut off before their manifest, and the points of manifests pruned;
- with `verify`, also named block and tail objects that fail verification on
  two reads in a row (a damaged object can never be replaced by a create-only
  put, so it must go). The daemon running the gc then puts back a verified
  copy from its own store when it holds one (`repaired`); otherwise the next
  upload of any snapshot naming it re-creates it, since uploads put every block
  the remote lacks.
- old snapshot manifests, by history pruning: per session, every manifest
  but the head, the labeled ones (checkpoints) and the `keep_history` newest
  others (at least one), where `keep_history` is what the session's head
  manifest names (its owner's setting when it published; a head naming none,
  as before this rule, prunes nothing). The head decides, not the daemon
  running the gc, so two daemons configured differently prune alike, and a
  session's history follows its current owner. One more than the head stays
  so that a daemon waking the session from the manifest that was the head a
  moment ago (a stale owner's racing manifest may land after it) still finds
  it; a wake that loses it anyway is refused as missing, never corrupt. Then
  the objects only the removed manifests named are swept as above.
Prefix manifests, leases and the identity object are never removed.

The race with uploads, and the rule that closes it. An upload skips the blocks
the remote already holds; an unreferenced old one (from a cut-off upload) may
be exactly what a gc is removing at that moment, and the upload's manifest
would then name a removed block. So gc runs are fenced:
1. A run first writes `gc/<n>-start.json` create-only (n = newest + 1) with a
   deadline `until` (start + max_s); it lists and deletes only after that, and
   nothing after its deadline; `gc/<n>-end.json` marks its end. A run is
   refused while another is active (create-only settles two starting at once).
2. An upload reads the newest run before its existence checks and again after
   its puts; when a run was active or began in between, it waits for that run
   to end and checks and puts again (remote/snapshots.py, `fenced`).
3. After writing its manifest it reads the newest run once more: a run that
   began before the manifest existed may have removed a block the upload
   reused, so it waits for the run to end and puts back what is missing
   (remote/snapshots.py, `commit_manifest`). A run that begins later lists the manifest.
So no manifest loses an object for good. A reader may find one missing for the
moment between its removal and its put-back; it refuses the snapshot (nothing
corrupt is restored) and a retry succeeds. The grace period is not what makes
this safe: it spares in-flight uploads from redoing their work, and leaves a
cut-off upload's blocks for its daemon to finish (daemons re-send their
unpublished heads at start). Clocks: a run whose end object is missing counts
as active until its deadline plus GC_SKEW_S (store/remote/client.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvwake.errors import BusyError, CorruptBlockError
from kvwake.store.core import StoreCore
from kvwake.store.index import BlockRef
from kvwake.store.remote.client import Remote
from kvwake.store import points
from kvwake.store.remote.points import check_point_object, put_point
from kvwake.store.remote.snapshots import check_block_object, check_tail_object, put_block, put_tail

__all__ = ["RemoteGcReport", "collect"]

GC_MAX_S = 600.0  # a run deletes nothing after this long; uploads wait at most this (plus skew) for one


@dataclass
class RemoteGcReport:
    """What one remote gc run found and did."""

    epoch: int = 0
    manifests: int = 0
    prefixes: int = 0
    pruned_manifests: int = 0  # old snapshot manifests removed by history pruning
    blocks: int = 0
    tails: int = 0
    points: int = 0
    removed_blocks: int = 0
    removed_tails: int = 0
    removed_points: int = 0
    removed_bytes: int = 0
    kept_young: int = 0  # unreferenced, but younger than the grace period
    verified: int = 0
    corrupt_removed: int = 0
    missing: int = 0  # named by a manifest but absent
    repaired: int = 0  # put back from this daemon's store
    incomplete: bool = False  # the run reached its deadline first
    ms: float = 0.0


def _start(remote: Remote, max_s: float) -> tuple[int, float]:
    """Write the run's start object; returns its epoch and deadline."""
    newest = remote.gc_run()
    if newest.active:
        raise BusyError(f"a remote gc by daemon {newest.daemon} is running (epoch {newest.epoch}, deletes nothing "
                        f"after {time.ctime(newest.until)})", owner=newest.daemon, epoch=newest.epoch)
    epoch, now = newest.epoch + 1, time.time()
    start = {"epoch": epoch, "daemon": remote.daemon_id, "time": now, "until": now + max_s}
    if not remote.put_new(f"{remote.ns}/gc/{epoch:012d}-start.json", json.dumps(start).encode()):
        raise BusyError(f"another remote gc started at the same moment (epoch {epoch})", epoch=epoch)
    return epoch, start["until"]


def _manifests(remote: Remote, report: RemoteGcReport) -> dict[str, dict]:
    """Every snapshot and prefix manifest, parsed, by object key.

    Raises CorruptBlockError when one cannot be read: what it names is unknown, so nothing may go.
    """
    snapshots = [o["path"] for o in remote.listing(f"{remote.ns}/snapshots/") if o["path"].endswith(".json")]
    prefixes = [o["path"] for o in remote.listing(f"{remote.ns}/prefixes/") if o["path"].endswith(".json")]
    report.manifests, report.prefixes = len(snapshots), len(prefixes)
    found: dict[str, dict] = {}
    for key, raw in zip(snapshots + prefixes, remote.parallel(remote.get, snapshots + prefixes)):
        try:
            found[key] = json.loads(raw or b"")
            _references({key: found[key]})  # what it names must be readable before anything goes
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptBlockError(f"remote gc: manifest {key} cannot be read ({exc}); nothing was removed. "
                                    "Move it aside by hand if it is damaged", block=key) from None
    return found


def _history(manifests: dict[str, dict], snapshots: str) -> list[str]:
    """The snapshot manifests history pruning may remove: per session, those beyond the head, every
    labeled one and the `keep_history` newest others its head names (none when the head names none)."""
    sessions: dict[str, list[str]] = {}
    for key in sorted(k for k in manifests if k.startswith(snapshots)):
        sessions.setdefault(key.rsplit("/", 1)[0], []).append(key)
    prunable = []
    for names in sessions.values():
        keep = (manifests[names[-1]].get("remote") or {}).get("keep_history")
        if not isinstance(keep, int):
            continue
        unlabeled = [k for k in names[:-1] if not (manifests[k].get("snapshot") or {}).get("label")]
        prunable += unlabeled[: max(0, len(unlabeled) - max(keep, 1))]
    return prunable


def _prune(remote: Remote, manifests: dict[str, dict], until: float, report: RemoteGcReport) -> None:
    """Delete the manifests history pruning may remove, until the deadline; those deleted leave `manifests`,
    so what only they named is swept next (one still there keeps its objects)."""
    def delete(key: str) -> str | None:
        if time.time() > until:
            return None
        remote.delete(key)
        return key

    gone = [k for k in remote.parallel(delete, _history(manifests, f"{remote.ns}/snapshots/")) if k is not None]
    for key in gone:
        del manifests[key]
    report.pruned_manifests = len(gone)


def _references(manifests: dict[str, dict]) -> tuple[dict[str, dict], dict[str, str], dict[str, dict]]:
    """Every block the manifests name (key -> its manifest entry), every tail (snapshot id -> digest) and
    every restore point (key -> its manifest entry)."""
    blocks: dict[str, dict] = {}
    tails: dict[str, str] = {}
    named_points: dict[str, dict] = {}
    for m in manifests.values():
        for entry in m["blocks"]:
            blocks[str(entry["key"])] = entry
        if m.get("tail"):
            tails[str(m["snapshot"]["id"])] = str(m["tail"]["digest"])
        for entry in m.get("points") or []:
            named_points[str(entry["key"])] = {**entry, "n_tokens": int(entry["n_tokens"])}
    return blocks, tails, named_points


def _objects(remote: Remote, kind: str) -> dict[str, dict]:
    """Object name (chain key or snapshot id) -> its listing entry, for blocks/ or tails/."""
    return {o["path"].rsplit("/", 1)[-1]: o for o in remote.listing(f"{remote.ns}/{kind}/")}


def _sweep(remote: Remote, found: dict[str, dict], named: set[str] | dict, path: Any, grace_s: float,
           until: float, report: RemoteGcReport) -> int:
    """Delete the unnamed objects older than grace_s, until the deadline; returns how many went."""
    now = time.time()
    old = [name for name, o in found.items() if name not in named and now - o["last_modified"].timestamp() > grace_s]
    report.kept_young += sum(1 for name in found if name not in named) - len(old)

    def delete(name: str) -> int | None:  # on the pool: returns the bytes freed, None past the deadline
        if time.time() > until:
            return None
        remote.delete(path(name))
        return int(found[name]["size"])

    freed = [n for n in remote.parallel(delete, old) if n is not None]
    report.incomplete |= len(freed) < len(old)
    report.removed_bytes += sum(freed)
    return len(freed)


def _check_twice(remote: Remote, key: str, check: Any) -> bool:
    """Whether the object at `key` is damaged: it must fail verification on two separate reads."""
    for _ in range(2):
        data = remote.get(key)
        if data is None:
            return False  # gone meanwhile: nothing to remove
        try:
            check(data)
            return False
        except ValueError:
            continue
    return True


def _checked(remote: Remote, path: str, present: bool, check: Any, until: float, put_back: Any) -> Any:
    """One named object's verification outcome: "ok", "late" (past the deadline), or ("corrupt" (removed:
    it failed twice) | "missing", whether `put_back()` put this daemon's copy back)."""
    if time.time() > until:
        return "late"
    outcome = "missing"
    if present:
        if not _check_twice(remote, path, check):
            return "ok"
        remote.delete(path)
        outcome = "corrupt"
    return outcome, put_back()


def _local_block(store: StoreCore | None, key: str) -> BlockRef | None:
    rows = store.rows("SELECT * FROM blocks WHERE key = ? AND quarantined = 0", (key,)) if store else []
    return BlockRef.from_row(rows[0]) if rows else None


def _verify(remote: Remote, store: StoreCore | None, blocks: dict[str, dict], tails: dict[str, str],
            found_blocks: dict, found_tails: dict, until: float, report: RemoteGcReport) -> None:
    """Remove named objects that fail verification twice; put back missing or removed ones from `store`.

    Each check runs on the pool and returns its outcome: "ok", "late" (past the deadline), or
    ("corrupt" | "missing", whether it was put back).
    """
    def block(key: str) -> Any:
        entry = blocks[key]

        def put_back() -> bool:
            ref = _local_block(store, key)
            return bool(ref is not None and ref.digest == entry.get("digest") and put_block(remote, store, ref))

        return _checked(remote, remote.block_key(key), key in found_blocks, lambda data: check_block_object(
            remote, key, data, entry.get("digest"), entry.get("raw_bytes")), until, put_back)

    def tail(sid: str) -> Any:
        def put_back() -> bool:
            record = store.snapshot(sid) if store and store.rows("SELECT id FROM snapshots WHERE id = ?", (sid,)) else None
            return bool(record is not None and record.tail is not None and record.tail.digest == tails[sid]
                        and put_tail(remote, store, record))

        return _checked(remote, remote.tail_key(sid), sid in found_tails,
                        lambda data: check_tail_object(remote, sid, data, tails[sid]), until, put_back)

    _count(report, remote.parallel(block, list(blocks)) + remote.parallel(tail, list(tails)))


def _count(report: RemoteGcReport, outcomes: list[Any]) -> None:
    """Add verification outcomes ("ok", "late", or (what was wrong, whether it was put back)) to the report."""
    report.verified += sum(1 for o in outcomes if o == "ok" or o[0] == "corrupt")
    report.corrupt_removed += sum(1 for o in outcomes if isinstance(o, tuple) and o[0] == "corrupt")
    report.missing += sum(1 for o in outcomes if isinstance(o, tuple) and o[0] == "missing")
    report.repaired += sum(1 for o in outcomes if isinstance(o, tuple) and o[1])
    report.incomplete |= "late" in outcomes


def _verify_points(remote: Remote, store: StoreCore | None, named: dict[str, dict], found: dict, until: float,
                   report: RemoteGcReport) -> None:
    """Remove named point objects that fail verification twice; put back missing or removed ones from
    `store` (`_verify`'s rules, for points)."""
    def point(key: str) -> Any:
        entry = named[key]

        def put_back() -> bool:
            ref = points.by_key(store, [key], remote.bundle).get(key) if store is not None else None
            return bool(ref is not None and ref.digest == entry.get("digest") and put_point(remote, store, ref))

        return _checked(remote, remote.point_key(key), key in found, lambda data: check_point_object(
            remote, key, data, entry["n_tokens"], entry.get("digest"), entry.get("raw_bytes")), until, put_back)

    _count(report, remote.parallel(point, list(named)))


def collect(remote: Remote, store: StoreCore | None = None, *, grace_s: float = 3600.0, verify: bool = False,
            max_s: float = GC_MAX_S) -> RemoteGcReport:
    """One remote gc run (the rules are in the module docstring); `store`: this daemon's, for repairs.

    Raises BusyError (another run is active), CorruptBlockError (a manifest cannot be read; nothing
    removed), RemoteUnavailableError.
    """
    began = time.monotonic()
    epoch, until = _start(remote, max_s)
    report = RemoteGcReport(epoch=epoch)
    try:
        found_blocks, found_tails = _objects(remote, "blocks"), _objects(remote, "tails")
        found_points = _objects(remote, "points")
        manifests = _manifests(remote, report)  # listed after the objects: a manifest newer than them counts
        _prune(remote, manifests, until, report)
        blocks, tails, named_points = _references(manifests)
        report.blocks, report.tails, report.points = len(found_blocks), len(found_tails), len(found_points)
        report.removed_blocks = _sweep(remote, found_blocks, blocks, remote.block_key, grace_s, until, report)
        report.removed_tails = _sweep(remote, found_tails, tails, remote.tail_key, grace_s, until, report)
        report.removed_points = _sweep(remote, found_points, named_points, remote.point_key, grace_s, until, report)
        if verify:
            _verify(remote, store, blocks, tails, found_blocks, found_tails, until, report)
            _verify_points(remote, store, named_points, found_points, until, report)
    finally:
        report.ms = round((time.monotonic() - began) * 1000, 3)
        end = {"epoch": report.epoch, "daemon": remote.daemon_id, "time": time.time(), "report": asdict(report)}
        remote.put_new(f"{remote.ns}/gc/{report.epoch:012d}-end.json", json.dumps(end).encode())
    return report
