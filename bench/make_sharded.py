"""The random-weight model of ../shared/gpu/make_model.py written as mlx-lm shards (model-0000N-of-0000M and its
index, as `mlx_lm.utils.save_model` writes a model users hold) in one pass, with the fleet's tool-calling template.

usage: python bench/make_sharded.py MAKE_MODEL_PY OUT [--shape llama8b]

make_model.py writes one file of the weights; the device parts that serve a model read shards, which were made by
loading that file and saving it again (the weights read and written a second time on every fresh machine). Here
make_model.py's own `main` runs with its one `mx.save_safetensors` of the weights written as `save_model`'s shards
instead: the same weights (its seed), the same shard files and index (docs/benchmarks.md, "The device parts' model").
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import make_shards

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAVE = mx.save_safetensors  # MLX's own, which the shards are written with while make_model.py's call is replaced


def save_sharded(path: str, weights: dict, metadata: dict | None = None) -> None:
    """`mx.save_safetensors(".../model.safetensors", weights)` as save_model's shards and index beside it."""
    folder = Path(path).parent
    total = sum(v.nbytes for v in weights.values())
    params = sum(v.size for v in weights.values())
    shards = make_shards(weights)
    name = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map = {}
    for i, shard in enumerate(shards):
        shard_name = name.format(i + 1, len(shards))
        SAVE(str(folder / shard_name), shard, metadata={"format": "mlx"})
        weight_map.update({k: shard_name for k in shard})
    index = {"metadata": {"total_size": total, "total_parameters": params},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def main() -> None:
    make_model, out, *rest = sys.argv[1:]
    mx.save_safetensors = save_sharded  # make_model.py's one call of it, for its weights
    sys.argv = [make_model, out, *rest]
    try:
        runpy.run_path(make_model, run_name="__main__")
    finally:
        mx.save_safetensors = SAVE
    # the fleet's agents send tool schemas and results: a template that renders them, with a tool-call format
    # mlx-lm knows (json_tools), as the test kit's agent model has
    from testkit.tinymodel import TOOLS_CHATML

    config_path = Path(out) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TOOLS_CHATML}))
    print("sharded:", sorted(p.name for p in Path(out).glob("*.safetensors")))


if __name__ == "__main__":
    main()
