"""Stores written by kvwake 0.1 (block file format 1, sha256 digests) stay readable and wakeable.

tests/fixtures/store-v1 was written by the format-1 code (commit e814480) before
the format changed: a tiny llama model, a store with one slept 40-token session
(two 16-token blocks and a tail), and a store of KV-like arrays.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.store import Store
from kvwake.store.format.codec import read_file_header
from testkit.kvdata import BUNDLE, assert_snapshot_exact

FIXTURE = Path(__file__).parent / "fixtures" / "store-v1"
FACTS = json.loads((FIXTURE / "facts.json").read_text())


def test_format_1_blocks_read_back_exactly(tmp_path):
    shutil.copytree(FIXTURE / "arrays-store", tmp_path / "store")
    with Store(tmp_path / "store", block_tokens=4) as store:
        record = store.snapshot(FACTS["arrays_snapshot"], bundle=BUNDLE)
        assert {read_file_header(store.files.absolute(b.file).read_bytes())[3] for b in record.blocks} == {1}
        assert_snapshot_exact(store, FACTS["arrays_snapshot"])


def test_a_format_1_session_wakes_bit_exactly_and_sleeps_again_in_the_current_format(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "v1")
    store = Store(tmp_path / "v1" / "data" / "store", block_tokens=16)
    engine = Engine(store, tmp_path / "v1" / "data", tmp_path / "v1" / "tiny-llama")
    try:
        assert engine.bundle.hash == FACTS["bundle"]  # the bundle hash did not move with the file format
        woken, info = engine.wake(FACTS["session"])
        assert info["blocks_from_disk"] == 2 and woken.tokens == FACTS["tokens"]
        record = store.snapshot(FACTS["snapshot"])
        stored = [store.read_block(ref) for ref in record.blocks]
        for i, c in enumerate(woken.cache):  # exactly the bytes format 1 stored
            for part in ("keys", "values"):
                got = np.asarray(getattr(c, part)[..., :32, :].view(mx.uint16))
                assert np.array_equal(got, np.concatenate([b[f"layers.{i}.{part}"].array for b in stored], axis=2))
        twin = Session("twin")
        engine.append(twin, tokens=FACTS["tokens"])
        params = GenerateParams(max_tokens=8)
        if mx.default_device() == mx.cpu:  # the fixture's KV was computed on a CPU: a prefill elsewhere differs
            assert engine.generate(woken, params).tokens == engine.generate(twin, params).tokens
        slept = engine.sleep(woken)
        assert slept["reused_blocks"] >= 2  # format-1 blocks are reused as they are
        again, _ = engine.wake(FACTS["session"])
        assert again.tokens == woken.tokens
    finally:
        engine.close()
        store.close()
