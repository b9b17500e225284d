"""Chain keys: fixed vectors, an independent reimplementation, and other processes agree."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvwake.store.format.keys import ROOT_KEY, block_key, chain_keys, tokens_from_bytes, tokens_to_bytes

VECTORS = json.loads((Path(__file__).parent / "fixtures" / "chain_keys.json").read_text())["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"{len(v['token_ids'])}tok-b{v['block_tokens']}")
def test_checked_in_vectors(vector):
    assert chain_keys(vector["bundle"], vector["token_ids"], vector["block_tokens"]) == vector["keys"]


def test_layout_matches_an_independent_implementation():
    bundle, tokens = "ab" * 32, [7, 8, 9, 10, 11, 12]
    parent = bytes(32)
    for start in (0, 3):
        raw = parent + bytes.fromhex(bundle) + struct.pack("<3I", *tokens[start : start + 3])
        parent = hashlib.sha256(raw).digest()
    assert chain_keys(bundle, tokens, 3)[-1] == parent.hex()


def test_same_keys_in_another_process_with_another_hash_seed():
    code = "from kvwake.store.format.keys import chain_keys; print(chain_keys('b0'*32, list(range(50)), 8))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(chain_keys("b0" * 32, list(range(50)), 8))


def test_a_key_names_its_whole_prefix():
    a = chain_keys("b0" * 32, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_keys("b0" * 32, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert a[0] != chain_keys("c1" * 32, [1, 2, 3, 4], 4)[0]  # bundle is part of the key
    assert block_key(ROOT_KEY, "b0" * 32, [1, 2, 3, 4]) == a[0]


def test_partial_block_has_no_key_and_bad_input_is_refused():
    assert chain_keys("b0" * 32, [1, 2, 3], 4) == []
    with pytest.raises(ValueError):
        tokens_to_bytes([-1])
    with pytest.raises(ValueError):
        tokens_to_bytes([2**32])
    with pytest.raises(ValueError, match="bundle hash"):
        block_key(ROOT_KEY, "short", [1])
    assert tokens_from_bytes(tokens_to_bytes([0, 1, 2**32 - 1])) == [0, 1, 2**32 - 1]


def test_chain_keys_key_only_whole_blocks_unless_partial():
    # An id past the keyed blocks is not read (as block by block before); a partial block's is.
    tokens = list(range(10)) + [-1]
    assert chain_keys("ab" * 32, tokens, 4) == chain_keys("ab" * 32, tokens[:8], 4)
    with pytest.raises(ValueError):
        chain_keys("ab" * 32, tokens, 4, partial=True)
