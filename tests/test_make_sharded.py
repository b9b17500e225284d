"""bench/make_sharded.py writes a model's weights as `mlx_lm.utils.save_model` would: the same shard files, bytes and
index, several shards as well as one (the device parts' 8B model is three shards)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils
from mlx.utils import tree_flatten

from bench import make_sharded


def one_tensor_a_shard(weights: dict, max_file_size_gb: int = 5) -> list[dict]:
    return [{name: value} for name, value in weights.items()]


def test_the_shards_are_save_models_byte_for_byte_one_or_several(tmp_path, monkeypatch):
    mx.random.seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    for several in (False, True):
        if several:  # one shard a tensor, in both writers: the multi-shard names and index
            monkeypatch.setattr(mlx_lm.utils, "make_shards", one_tensor_a_shard)
            monkeypatch.setattr(make_sharded, "make_shards", one_tensor_a_shard)
        theirs, ours = tmp_path / f"theirs-{several}", tmp_path / f"ours-{several}"
        mlx_lm.utils.save_model(theirs, model)
        ours.mkdir()
        make_sharded.save_sharded(str(ours / "model.safetensors"), dict(weights))
        names = sorted(p.name for p in theirs.iterdir())
        assert names == sorted(p.name for p in ours.iterdir())
        assert (len(names) > 2) == several  # several shards and the index, or one file and the index
        for name in names:
            assert (theirs / name).read_bytes() == (ours / name).read_bytes(), name
