"""Write a random-weight mlx-lm model folder of Gemma 3's shape, or its plain-attention cousin (issue 52's
fleet benchmark on the GPU machine: timings are real, the text is noise).

usage: python3 bench/hybrid_model.py OUT_DIR [--shape gemma3-4b|gemma3-12b|tiny] [--plain] [--wrapped] [--seed N]

Gemma 3 (`gemma3_text`): five sliding-window layers (a 1024-token window, mlx-lm's RotatingKVCache) to one
global layer (KVCache), head dim 256.
  gemma3-4b:  Gemma-3-4B's text shape (the default): 34 layers (5 global), 8 heads, 4 KV heads of 256; bf16 KV
              of a global layer 4 KiB/token (20 KiB/token for the 5), a sliding layer's window 4 MiB (116 MiB
              for the 29): a restore point weighs about 46 of kvwake's 128-token blocks; about 7 GB of weights
              with this vocabulary.
  gemma3-12b: Gemma-3-12B's: 48 layers (8 global), 16 heads, 8 KV heads; 64 KiB/token of global KV, a point
              320 MiB (40 blocks); about 21 GB of weights. A fleet's points fill tens of GB of store: mind
              the machine's disk.
  tiny:       6 layers (1 global), a 16-token window: for the tests here.
--wrapped: as Gemma 3's 4B, 12B and 27B checkpoints come, mlx-lm's `gemma3` (a multimodal wrapper, its text model
in `language_model`, its config in `text_config`), the same weights under that prefix: what users load.
--plain: the cousin, every layer global (sliding_window_pattern 1): the same parameters (the same seed
gives the same weights), only the attention span differs, so the two runs compare restore points against
plain blocks. The tokenizer is a small byte-level BPE, as ../shared/gpu/make_model.py's, with the test kit's
TOOLS_CHATML template (the fleet's agents send tools; bench/device.sh's model() sets the same). Weights are
saved in mlx-lm's shards, as a user holds a model.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import mlx.core as mx
from mlx_lm.models import gemma3, gemma3_text
from mlx_lm.utils import save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: testkit is the repository's

from testkit.tinymodel import TOOLS_CHATML  # noqa: E402

GEMMA3 = dict(model_type="gemma3_text", rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
              sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=131072,
              rope_scaling={"factor": 8.0, "rope_type": "linear"})
SHAPES = {
    "gemma3-12b": dict(hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma3-4b": dict(hidden_size=2560, num_hidden_layers=34, intermediate_size=10240, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "tiny": dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16),
}
CORPUS = ("Agents keep long conversations with tools, plans and notes. The daemon sleeps and wakes them. "
          "Summarise the archive, list the open questions, and propose the next step. 0123456789 ") * 40


def write_tokenizer(out: pathlib.Path, max_length: int) -> Tokenizer:
    """A byte-level BPE of 512 tokens (any text encodes) and its config, with TOOLS_CHATML."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": TOOLS_CHATML, "model_max_length": max_length}))
    return tok


def config_of(shape: str, plain: bool, tok: Tokenizer) -> dict:
    """The model's config.json: Gemma 3's, at `shape`; `plain`: every layer global."""
    cfg = {**GEMMA3, **SHAPES[shape], "vocab_size": tok.get_vocab_size(), "eos_token_id": tok.token_to_id("<|im_end|>")}
    if plain:
        cfg["sliding_window_pattern"] = 1  # layer i is global when (i + 1) % pattern == 0: all of them
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="gemma3-4b", choices=SHAPES)
    ap.add_argument("--plain", action="store_true", help="the cousin: every layer global attention")
    ap.add_argument("--wrapped", action="store_true", help="as Gemma 3's 4B-27B checkpoints: mlx-lm's gemma3 wrapper")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_of(a.shape, a.plain, write_tokenizer(out, GEMMA3["max_position_embeddings"]))
    if a.wrapped:
        cfg = {"model_type": "gemma3", "text_config": cfg, "vocab_size": cfg["vocab_size"],
               "eos_token_id": cfg["eos_token_id"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.random.seed(a.seed)
    model = gemma3.Model(gemma3.ModelArgs.from_dict(cfg)) if a.wrapped else \
        gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    save_model(out, model, donate_model=True)
    print(out)


if __name__ == "__main__":
    main()
