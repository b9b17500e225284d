"""Tiny random-weight model folders that mlx_lm.load accepts, with a real byte-level tokenizer.

The tokenizer maps every byte to one token (ids 0-255, GPT-2 byte-level
alphabet) plus ChatML specials, so any text round-trips. Two chat templates:
"chatml" (takes a system role) and "no-system" (raises on one, like Gemma's).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHS = {
    "llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 4096},
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(path: Path, template: str) -> int:
    table = bytes_to_unicode()
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def make_model_dir(path: Path, *, arch: str = "llama", template: str = CHATML, seed: int = 0,
                   dtype: mx.Dtype = mx.bfloat16, **overrides) -> Path:
    """Write a loadable tiny model folder at `path` and return it."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, template)
    config = {**ARCHS[arch], "vocab_size": vocab, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Larger-than-default init so greedy continuations depend on the context.
    params = [(k, (mx.random.normal(v.shape) * 0.5).astype(dtype)) for k, v in tree_flatten(model.parameters())]
    mx.save_safetensors(str(path / "model.safetensors"), dict(params), metadata={"format": "mlx"})
    return path


def eos_id(path: Path) -> int:
    return json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]


__all__ = ["CHATML", "NO_SYSTEM", "eos_id", "make_model_dir", "nn"]
