"""Tiny random-weight model folders that mlx_lm.load accepts, with a real byte-level tokenizer.

The tokenizer maps every byte to one token (ids 0-255, GPT-2 byte-level
alphabet) plus ChatML specials, so any text round-trips. Three chat templates:
CHATML (takes a system role), NO_SYSTEM (raises on one, like Gemma's) and
TOOLS_CHATML (CHATML that renders a `tools` list first and assistant
`tool_calls` in the json_tools format, so mlx-lm gives the tokenizer that tool
parser). `make_scripted_model` makes a model that writes a fixed reply (a
tool call by default), for tests of tool-call parsing.

ARCHS holds config.json contents (keys as the HF configs name them) for a
plain-KV model (llama), one with sliding-window ring buffers besides global
layers (gemma3_text, window 8: short prompts wrap the ring), and two hybrids
with recurrent state (lfm2: conv state + attention; qwen3_next: gated delta
net + attention + MoE, which on CPU runs in float32 only, see FLOAT32_ONLY),
one whose every layer is a CacheList of both (falcon_h1), and one of recurrent
state alone (mamba2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# mlx-lm infers the json_tools parser from "<tool_call>" and "tool_call.name" in a template.
TOOLS_CHATML = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for tool_call in m.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def after_tool_template(tools: str = "{{ tools | tojson }}") -> str:
    """TOOLS_CHATML, but an assistant turn that follows a tool's output opens with a tab, not a newline, so a
    scripted model (make_scripted_model's `more`) answers a tool's output otherwise than a user's words.
    `tools`: how the tools list renders (Jinja)."""
    return (
        "{% if tools %}TOOLS:" + tools + "\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}"
        "{{ '\t' if m['role'] == 'assistant' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'tool' "
        "else '\n' }}{{ m['content'] }}"
        "{% for tool_call in m.tool_calls or [] %}{% set tool_call = tool_call.function %}"
        '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
        "{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant"
        "{{ '\t' if messages[-1]['role'] == 'tool' else '\n' }}{% endif %}"
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
    # Layers 0, 1 slide over the last 8 tokens (RotatingKVCache); layer 2 is global (KVCache).
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16,
                    "sliding_window": 8, "sliding_window_pattern": 3, "max_position_embeddings": 4096},
    # Conv layers keep a recurrent state (ArraysCache); the middle layer is attention (KVCache).
    "lfm2": {"model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 4096, "norm_eps": 1e-5, "conv_bias": False,
             "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 32,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False, "rope_theta": 1000000.0,
             "layer_types": ["conv", "full_attention", "conv"]},
    # Linear-attention (gated delta net) layers 0, 2 keep conv + SSM state; layers 1, 3 are attention.
    "qwen3_next": {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                   "max_position_embeddings": 4096, "full_attention_interval": 2, "tie_word_embeddings": False},
    # Every layer a CacheList of a Mamba-2 state (ArraysCache) and attention KV (KVCache).
    "falcon_h1": {"model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_d_conv": 4,
                  "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_n_heads": 4,
                  "mamba_chunk_size": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "max_position_embeddings": 4096, "tie_word_embeddings": True},
    # Recurrent state only (ArraysCache): no attention at all.
    "mamba2": {"model_type": "mamba2", "num_heads": 4, "head_dim": 16, "hidden_size": 32, "intermediate_size": 64,
               "state_size": 16, "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5, "conv_kernel": 4, "n_groups": 1,
               "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": True,
               "time_step_limit": [0.0, 1e30], "time_step_rank": "auto"},
}
FLOAT32_ONLY = {"qwen3_next"}  # MoE gather_mm has no bfloat16 kernel on CPU


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


def write_tokenizer(path: Path, template: str, added: Sequence[str] = ()) -> int:
    """Byte-level tokenizer files; `added`: whole strings that are one token each (not special)."""
    table = bytes_to_unicode()
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(a, normalized=False) for a in added])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def make_model_dir(path: Path, *, arch: str = "llama", template: str = CHATML, seed: int = 0,
                   dtype: mx.Dtype | None = None, ascii_replies: bool = False, added: Sequence[str] = (),
                   **overrides) -> Path:
    """Write a loadable tiny model folder at `path` and return it.

    dtype: of the weights; None means bfloat16, or float32 for FLOAT32_ONLY archs.
    ascii_replies: zero the output rows of the bytes a chat re-render would not give back, so greedy
      replies re-render to the same tokens: 128-255 (alone they decode to U+FFFD), NUL (mlx-lm's BPE
      detokenizer turns it into "Ā") and space (it trims one that starts a reply).
    added: strings that become one (non-special) token each, after the specials.
    """
    if dtype is None:
        dtype = mx.float32 if arch in FLOAT32_ONLY else mx.bfloat16
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, template, added)
    config = {**ARCHS[arch], "vocab_size": vocab, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Larger-than-default init so greedy continuations depend on the context.
    params = {k: (mx.random.normal(v.shape) * 0.5).astype(dtype) for k, v in tree_flatten(model.parameters())}
    if ascii_replies:
        head = "lm_head.weight" if "lm_head.weight" in params else \
            next(k for k in params if k.endswith(("embed_tokens.weight", "embeddings.weight")))  # tied
        for lo, hi in ((0, 1), (32, 33), (128, 256)):
            params[head][lo:hi] = 0
    mx.save_safetensors(str(path / "model.safetensors"), params, metadata={"format": "mlx"})
    return path


def eos_id(path: Path) -> int:
    return json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]


# A scripted reply for the json_tools format: one call, as Qwen-style models write it.
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOL_SCRIPT = ("<tool_call>", WEATHER_CALL, "</tool_call>")


def make_scripted_model(path: Path, script: Sequence[str] = TOOL_SCRIPT, *, template: str = TOOLS_CHATML,
                        alpha: float = 4.0, more: Sequence[tuple[str, Sequence[str]]] = (), **config: Any) -> Path:
    """A model folder whose greedy reply to any chat prompt is "".join(script), then EOS.

    A llama (untied embeddings) whose attention and MLP outputs are zero (o_proj, down_proj),
    so each layer passes the residual through and the logits depend on the current token
    only: lm_head row next(t) = alpha * E[t] / |E[t]|, all other rows zero. After the final
    RMSNorm the chain's logit is alpha * sqrt(64) = 8 alpha; another chain row gets 8 alpha
    times the cosine of two random 64-d embeddings (about 0.125 each way). Each script piece
    is one added token, so the chain "\n" (the last token of the generation prompt) ->
    piece 0 -> ... -> <|im_end|> (EOS) has no repeated token; pieces must be unique and
    longer than one byte. The default script makes one get_weather call in the json_tools
    format that TOOLS_CHATML names. `more`: further chains, each (the one-byte text its prompt ends
    with instead of "\n", its pieces), for a template whose generation prompt ends otherwise in some
    turns (bench/codex_cli.py: after a tool's output); all pieces of all chains are unique.
    """
    pieces = [*script, *(p for _, chain in more for p in chain)]
    assert len(set(pieces)) == len(pieces) and all(len(p.encode()) > 1 for p in pieces), pieces
    # One layer: its attention output is zero anyway, and a prefill, which evaluates the cache and no logits,
    # then computes no attention at all (with a second layer, whose keys take the first one's output, it
    # did: quadratic in an agent's 30-40k-token prompt; tests/test_agent_clis.py)
    make_model_dir(path, template=template, dtype=mx.float32, added=pieces, tie_word_embeddings=False,
                   **{"num_hidden_layers": 1, **config})
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    weights = mx.load(str(path / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    head = mx.zeros_like(weights["lm_head.weight"])
    for start, chain in (("\n", script), *more):
        ids = [tok.token_to_id(t) for t in (bytes_to_unicode()[ord(start)], *chain, "<|im_end|>")]
        for t, nxt in zip(ids, ids[1:]):  # EOS ends every chain: its row adds up their last pieces
            head[nxt] = head[nxt] + alpha * embed[t] / mx.linalg.norm(embed[t])
    weights["lm_head.weight"] = head
    weights["model.norm.weight"] = mx.ones_like(weights["model.norm.weight"])
    for name in list(weights):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


__all__ = ["ARCHS", "CHATML", "FLOAT32_ONLY", "NO_SYSTEM", "TOOLS_CHATML", "TOOL_SCRIPT", "WEATHER_CALL",
           "after_tool_template", "eos_id", "make_model_dir", "make_scripted_model", "nn"]
