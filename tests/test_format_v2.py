"""Stores written in block format 2 (BLAKE3 section digests) stay readable, verified and checked by fsck.

tests/fixtures/store-v2 was written by the format-2 code (the commit before format 3): one store of
4-token blocks with three 10-token snapshots, one per codec (planes-zstd, raw, zstd), each two
blocks and a tail (facts.json names them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvwake.errors import CorruptBlockError
from kvwake.store import Store
from kvwake.store.format.codec import FORMAT_VERSION, read_file_header
from testkit.kvdata import BUNDLE, assert_snapshot_exact, write_snapshot

FIXTURE = Path(__file__).parent / "fixtures" / "store-v2"
FACTS = json.loads((FIXTURE / "facts.json").read_text())


@pytest.fixture
def old_store(tmp_path):
    shutil.copytree(FIXTURE / "arrays-store", tmp_path / "store")
    with Store(tmp_path / "store", block_tokens=4) as store:
        yield store


def _versions(store, snapshot_id: str) -> set[int]:
    record = store.snapshot(snapshot_id, bundle=BUNDLE)
    files = [b.file for b in record.blocks] + [record.tail.file]
    return {read_file_header(store.files.absolute(f).read_bytes())[3] for f in files}


@pytest.mark.parametrize("codec", ["planes-zstd", "raw", "zstd"])
def test_format_2_snapshots_read_back_exactly_and_fsck_finds_them_sound(old_store, codec):
    snapshot = FACTS["snapshots"][codec]["id"]
    assert _versions(old_store, snapshot) == {2}
    assert_snapshot_exact(old_store, snapshot)
    report = old_store.fsck()
    assert report.ok and report.blocks_checked == 6 and report.snapshots_checked == 3


def test_a_flipped_byte_in_a_format_2_block_is_a_corrupt_block_naming_it(old_store):
    snapshot = FACTS["snapshots"]["planes-zstd"]["id"]
    record = old_store.snapshot(snapshot)
    ref = record.blocks[1]
    path = old_store.files.absolute(ref.file)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # in the last section's content: only its digest can tell
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="payload digest") as err:
        list(old_store.iter_blocks(record))
    assert err.value.data["block"] == ref.key and err.value.data["snapshot_id"] == snapshot
    assert [b["block"] for b in old_store.fsck().bad_blocks] == [ref.key]


def test_new_snapshots_beside_format_2_blocks_reuse_them_and_write_format_4(old_store):
    old = FACTS["snapshots"]["planes-zstd"]
    info = write_snapshot(old_store, "next", old["tokens"] + [5, 6, 7, 8, 9, 10])
    assert info.reused_blocks == 2 and info.new_blocks == 2
    record = old_store.snapshot(info.id, bundle=BUNDLE)
    versions = [read_file_header(old_store.files.absolute(b.file).read_bytes())[3] for b in record.blocks]
    assert versions == [2, 2, FORMAT_VERSION, FORMAT_VERSION] and FORMAT_VERSION == 4
    assert_snapshot_exact(old_store, info.id)
    assert old_store.fsck().ok
