"""bench/hybrid_model.py (issue 52's GPU fleet model) at its tiny shape: it writes folders mlx-lm loads, Gemma 3's
five sliding-window layers to one global and the plain cousin's global ones, with the same weights, a
template that renders the fleet's tools, and kvwake serves the first through restore points and cuts the
second by token."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvwake.daemon.config import Tuning
from kvwake.daemon.model.engine import Engine
from kvwake.store import Store

ROOT = Path(__file__).resolve().parent.parent
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{"hybrid": folder, "plain": folder, "wrapped": folder}, written by the script as the device runs it."""
    root = tmp_path_factory.mktemp("hybrid")
    folders = {"hybrid": root / "hybrid", "plain": root / "plain", "wrapped": root / "wrapped"}
    argv = sys.argv
    try:
        for name, folder in folders.items():  # run as the device runs it (its __main__), in this process
            sys.argv = ["hybrid_model.py", str(folder), "--shape", "tiny", *({"plain": ["--plain"],
                                                                             "wrapped": ["--wrapped"]}.get(name, []))]
            runpy.run_path(str(ROOT / "bench" / "hybrid_model.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return folders


def test_the_folders_load_in_mlx_lm_as_gemma3_and_its_plain_cousin(made):
    (hybrid, tok), (plain, _) = (mlx_lm.load(str(made[name])) for name in ("hybrid", "plain"))
    kinds = [type(c) for c in make_prompt_cache(hybrid)]
    assert kinds == [RotatingKVCache] * 5 + [KVCache]  # 5:1 local:global
    assert make_prompt_cache(hybrid)[0].max_size == hybrid.args.sliding_window == 16
    assert all(type(c) is KVCache for c in make_prompt_cache(plain))
    weights = dict(tree_flatten(plain.parameters()))  # the same parameters: only the attention span differs
    assert all(np.array_equal(np.array(v.astype(mx.float32)), np.array(weights[k].astype(mx.float32)))
               for k, v in tree_flatten(hybrid.parameters()))
    ids = tok.apply_chat_template([{"role": "system", "content": "Plan."}, {"role": "user", "content": "Go."}],
                                  tools=[TOOL], add_generation_prompt=True)
    assert '"read_file"' in tok.decode(ids) and tok.decode(ids).endswith("<|im_start|>assistant\n")
    logits = hybrid(mx.array([ids * 3]))  # past the window
    assert logits.dtype == mx.bfloat16 and mx.isfinite(logits).all().item()


@pytest.mark.parametrize("name", ["hybrid", "plain", "wrapped"])
def test_kvwake_serves_the_hybrid_through_restore_points_and_cuts_the_cousin(made, tmp_path, name):
    """The wrapped hybrid (Gemma 3's 4B-27B checkpoints' structure) as the hybrid: points, cut, packed (where
    turns pack: the GPU's default)."""
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, made[name], tuning=Tuning(pack_prefill=True))
    try:
        assert engine.cuttable == (name == "plain") and engine.points.enabled == (name != "plain")
        assert engine.points.cuts == (name != "plain") and engine.planner.pack_prefill
    finally:
        engine.close()
        store.close()
