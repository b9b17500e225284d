"""Prompts tokenized piece by piece, each piece once: the same ids as tokenizing them whole, or off."""

from __future__ import annotations

import json
import logging
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from kvwake.daemon.model import piece_tokens as pieces_module
from kvwake.daemon.model.chat import ChatTemplate
from kvwake.daemon.model.piece_tokens import Pieces
from testkit.tinymodel import CHATML, SPECIALS, write_tokenizer

TEXT = ("The agent reads the manual, plans twelve steps and calls its tools. 12345 tokens, 3.14 ms; "
        "naïve café — done!\n\n  Indented line.\tTabbed. ") * 8


def save(path: Path, tok: Tokenizer) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None}))
    return path


def metaspace(path: Path, special: AddedToken | None = None) -> Path:
    """A sentencepiece-like BPE: Metaspace prepends '▁' to the input's first word only ("first")."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set(TEXT + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789▁?!.,:;-_'\"<>|/\n\t "))
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator([TEXT] * 4, trainer)
    if special is not None:
        tok.add_special_tokens([special])
    return save(path, tok)


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("toks")
    (root / "bytes").mkdir()
    write_tokenizer(root / "bytes", CHATML, added=["<tool_call>", "</tool_call>"])
    return {"bytes": load_tokenizer(root / "bytes"), "metaspace": load_tokenizer(metaspace(root / "metaspace"))}


def whole(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_a_growing_conversation_encodes_only_its_new_pieces_to_the_same_ids(tokenizers_, kind):
    tokenizer = tokenizers_[kind]
    template = ChatTemplate(tokenizer)
    assert template.pieces.on
    messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": "First: what now?"}]
    for turn in range(4):
        before = dict(template.pieces.stats)
        ids = template.render(messages)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ids == whole(tokenizer, text)
        if turn:  # the earlier turns' pieces come from memory: each turn encodes its own few
            assert template.pieces.stats["pieces_encoded"] - before["pieces_encoded"] <= 4
            assert template.pieces.stats["pieces_reused"] - before["pieces_reused"] >= 2 * turn + 2
        messages += [{"role": "assistant", "content": f" Reply {turn}: <tool_call>{{}}</tool_call> ok "},
                     {"role": "user", "content": f"<|im_start|> inside a message {turn}\n\n"}]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.sampled_from(SPECIALS + [" ", "\n", "12", "a", "▁x", "<tool_call>", "é"]),
                                st.text(max_size=12)), max_size=14))
def test_any_text_encodes_to_the_same_ids_pieced_as_whole(tokenizers_, parts):
    text = "".join(parts)
    for tokenizer in tokenizers_.values():
        pieces = Pieces(tokenizer)
        assert pieces.on and pieces._pieced(text) == whole(tokenizer, text), text


def test_an_added_token_that_strips_its_neighbours_turns_pieces_off(tmp_path):
    tokenizer = load_tokenizer(metaspace(tmp_path / "lstrip", AddedToken("<mask>", lstrip=True, special=True)))
    pieces = Pieces(tokenizer)
    assert not pieces.on
    text = "a <mask> b<|im_start|>user\nhi"
    assert pieces.encode(text) == whole(tokenizer, text)


def test_a_prompt_that_pieces_differently_turns_pieces_off_and_is_encoded_whole(tokenizers_, monkeypatch, caplog):
    tokenizer = tokenizers_["bytes"]
    pieces = Pieces(tokenizer)
    assert pieces.on
    monkeypatch.setattr(pieces, "_pieced", lambda text: [0])  # what a tokenizer the probes missed would do
    with caplog.at_level(logging.WARNING, logger="kvwake.pieces"):
        ids = pieces.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids == whole(tokenizer, "<|im_start|>user\nhello<|im_end|>") and not pieces.on
    assert "pieced encoding differs" in caplog.text


def test_pieces_kept_are_bounded_in_bytes_least_recently_used_out(tokenizers_, monkeypatch):
    bound = 2 * pieces_module.cost("<|im_start|>" + "x" * 16, array("i", range(17))) + 10  # two pieces
    monkeypatch.setattr(pieces_module, "KEEP_BYTES", bound)
    monkeypatch.setattr(pieces_module, "VERIFY_FIRST", 0)
    tokenizer = tokenizers_["bytes"]
    pieces = Pieces(tokenizer)
    for k in range(6):
        text = f"<|im_start|>{'x' * 15}{k}"
        assert pieces.encode(text) == whole(tokenizer, text)
        assert pieces._kept <= bound and pieces._kept == sum(pieces_module.cost(k, v) for k, v in pieces._ids.items())
    assert "<|im_start|>xxxxxxxxxxxxxxx5" in pieces._ids and "<|im_start|>xxxxxxxxxxxxxxx0" not in pieces._ids


def test_a_prompt_whose_own_pieces_are_the_oldest_kept_encodes_when_new_pieces_push_them_out(tokenizers_,
                                                                                            monkeypatch):
    # Was a KeyError: the new pieces were kept first, and keeping them evicted the least recently used,
    # which were this prompt's own earlier pieces (not yet touched by this render).
    bound = 2 * pieces_module.cost("<|im_start|>" + "a" * 15, array("i", range(16))) + 10  # two pieces
    monkeypatch.setattr(pieces_module, "KEEP_BYTES", bound)
    monkeypatch.setattr(pieces_module, "VERIFY_FIRST", 0)
    tokenizer = tokenizers_["bytes"]
    pieces = Pieces(tokenizer)
    first = "<|im_start|>" + "a" * 15 + "<|im_start|>" + "b" * 15
    assert pieces.encode(first) == whole(tokenizer, first)
    longer = first + "<|im_start|>" + "c" * 15
    assert pieces.encode(longer) == whole(tokenizer, longer)
    assert pieces._kept <= bound


def test_an_added_token_that_runs_into_a_cut_token_turns_pieces_off(tmp_path):
    # "x<|im" is matched leftmost before "<|im_start|>", so the tokenizer does not split where the special
    # token begins: cutting there would give other ids. Such a tokenizer is tokenized whole.
    (tmp_path / "overlap").mkdir()
    write_tokenizer(tmp_path / "overlap", CHATML, added=["x<|im"])
    tokenizer = load_tokenizer(tmp_path / "overlap")
    text = "ax<|im_start|>user\nhi"
    pieces = Pieces(tokenizer)
    assert not pieces.on and pieces.encode(text) == whole(tokenizer, text)


def test_two_renders_encoding_one_new_piece_at_once_keep_it_once(tokenizers_):
    # Renders run on worker threads at once and encode outside the pieces' lock: both may encode the same
    # new piece and keep it. Kept twice, its bytes were counted twice (the budget shrank for good).
    import threading

    pieces = Pieces(tokenizers_["bytes"])
    backend, both = pieces.backend, threading.Barrier(2)

    class Together:  # each render's encoding waits for the other's: both miss the piece
        def encode_batch(self, texts, **options):
            both.wait(10)
            return backend.encode_batch(texts, **options)

        def __getattr__(self, name):
            return getattr(backend, name)

    pieces.backend = Together()
    text = "<|im_start|>system\n" + TEXT + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    got: list[list[int]] = []
    workers = [threading.Thread(target=lambda: got.append(pieces.encode(text))) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    pieces.backend = backend
    assert got == [whole(tokenizers_["bytes"], text)] * 2
    assert pieces._kept == sum(pieces_module.cost(p, ids) for p, ids in pieces._ids.items())
    assert pieces._verify == 0  # the first real prompt's whole-encode check ran once, not twice
