"""Export/import: portable files round-trip, dedup on import, and hostile files are refused whole."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from kvwake.errors import InvalidParamsError
from kvwake.store import Store
from testkit.kvdata import BUNDLE, assert_snapshot_exact, write_snapshot

TOKENS = list(range(200, 215))


@pytest.fixture
def exported(store, tmp_path):
    info = write_snapshot(store, "agent", TOKENS, label="v1", metadata={"messages": [{"role": "user", "content": "hi"}]})
    path = tmp_path / "agent.kvsnap"
    store.export(info.id, path)
    return info, path


@pytest.fixture
def target(tmp_path):
    s = Store(tmp_path / "target", block_tokens=4)
    yield s
    s.close()


def members(path):
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def rewrite(path, out, edit):
    """Write a copy of a snapshot file with edit(name, data, info) -> (name, data, info) | None applied."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members(path):
            edited = edit(info.name, data, info)
            if edited is not None:
                name, data, info = edited
                info.name, info.size = name, len(data)
                tar.addfile(info, io.BytesIO(data))


def assert_nothing_imported(target):
    assert target.snapshots() == [] and target.rows("SELECT count(*) AS n FROM blocks")[0]["n"] == 0
    assert [p for p in target.files.walk()] == []


def test_round_trip_into_another_store(exported, target):
    info, path = exported
    result = target.import_(path)
    assert result["snapshot_id"] == info.id and result["new_blocks"] == 3
    assert_snapshot_exact(target, info.id)
    record = target.snapshot(info.id)
    assert record.label == "v1" and record.metadata["messages"][0]["content"] == "hi"
    assert target.bundle(BUNDLE) == {"model": "test-a"}
    names = [m.name for m, _ in members(path)]
    assert names[0] == "manifest.json" and names[-1] == "tail.kvb" and len(names) == 5


def test_importing_twice_or_into_the_source_stores_blocks_once(exported, store, target):
    info, path = exported
    target.import_(path)
    again = target.import_(path)
    assert again["existed"] and again["snapshot_id"] == info.id
    other = target.import_(path, session_id="copy")
    assert not other["existed"] and other["snapshot_id"] != info.id and other["session_id"] == "copy"
    assert other["new_blocks"] == 0 and other["reused_blocks"] == 3
    assert target.rows("SELECT count(*) AS n FROM blocks")[0]["n"] == 3
    assert_snapshot_exact(target, other["snapshot_id"])


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda n, d, i: (n, d[:-1] + bytes([d[-1] ^ 1]), i) if n.startswith("blocks/") else (n, d, i), "damaged|digest|manifest"),
        (lambda n, d, i: ("../../evil.kvb", d, i) if n == "tail.kvb" else (n, d, i), "expected regular member 'tail.kvb'"),
        (lambda n, d, i: ("/etc/passwd", d, i) if n.startswith("blocks/") else (n, d, i), "expected regular member"),
        (lambda n, d, i: (n, d + b"\0" * 4096, i) if n.startswith("blocks/") else (n, d, i), "more than the"),
        (lambda n, d, i: None if n == "tail.kvb" else (n, d, i), "truncated|ends before"),
        (lambda n, d, i: (n, json.dumps({**json.loads(d), "snapshot": {**json.loads(d)["snapshot"], "digest": "00" * 32}}).encode(), i)
         if n == "manifest.json" else (n, d, i), "snapshot digest"),
        (lambda n, d, i: (n, b"{not json", i) if n == "manifest.json" else (n, d, i), "malformed"),
    ],
    ids=["flipped-byte", "path-traversal", "absolute-path", "oversized-entry", "missing-member", "digest", "bad-json"],
)
def test_tampered_files_are_refused_and_nothing_is_committed(exported, target, tmp_path, edit, why):
    _, path = exported
    bad = tmp_path / "bad.kvsnap"
    rewrite(path, bad, edit)
    with pytest.raises(InvalidParamsError, match=why):
        target.import_(bad)
    assert_nothing_imported(target)


def test_symlink_member_is_refused(exported, target, tmp_path):
    _, path = exported
    bad = tmp_path / "link.kvsnap"
    with tarfile.open(bad, "w") as tar:
        for info, data in members(path):
            if info.name.startswith("blocks/") and not any(m.name.startswith("blocks/") for m in tar.getmembers()):
                link = tarfile.TarInfo(info.name)
                link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(link)
                continue
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(InvalidParamsError, match="type"):
        target.import_(bad)
    assert_nothing_imported(target)


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.99])
def test_truncated_file_is_refused(exported, target, tmp_path, keep):
    _, path = exported
    bad = tmp_path / "short.kvsnap"
    with tarfile.open(path) as tar:
        end = max(m.offset_data + m.size for m in tar.getmembers())  # past here is only tar padding
    bad.write_bytes(path.read_bytes()[: int(end * keep)])
    with pytest.raises(InvalidParamsError, match="cannot import short.kvsnap"):
        target.import_(bad)
    assert_nothing_imported(target)


def test_not_a_snapshot_file(target, tmp_path):
    junk = tmp_path / "junk.kvsnap"
    junk.write_bytes(b"hello" * 100)
    with pytest.raises(InvalidParamsError, match="not a readable snapshot"):
        target.import_(junk)


def test_other_block_size_is_refused(exported, tmp_path):
    _, path = exported
    other = Store(tmp_path / "b8", block_tokens=8)
    with pytest.raises(InvalidParamsError, match="4-token blocks"):
        other.import_(path)
    other.close()
