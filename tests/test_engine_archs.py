"""Engine on tiny models of each cache family: plain KV (llama), sliding window (gemma3_text), recurrent (lfm2,
qwen3_next). Exact sleep/wake in chat mode, prefix reuse on or off, divergence, generating twice, tools.

Most tests use `ascii_replies` models: their greedy replies re-render through the chat template to the same
tokens, so the turn after a wake extends the restored state instead of rebuilding it (a rebuild would make
a wrong restore invisible). The divergence test uses a plain model, whose replies do not re-render.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache

from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session, common_prefix
from kvwake.errors import InvalidParamsError
from kvwake.store import Store
from testkit.tinymodel import ARCHS, TOOLS_CHATML, make_model_dir

NAMES = ["llama", "gemma3_text", "lfm2", "qwen3_next"]
CUTTABLE = {"llama"}
SYSTEM = "You are a careful agent. Follow the tool manual. " * 3
GREEDY = GenerateParams(max_tokens=12)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """folder(arch, plain=False): a model folder, made once per module. Not plain: ASCII replies, tools template."""
    made: dict[tuple[str, bool], Path] = {}

    def folder(arch: str, plain: bool = False) -> Path:
        if (arch, plain) not in made:
            path = tmp_path_factory.mktemp("models") / f"{arch}-{'plain' if plain else 'ascii'}"
            made[arch, plain] = make_model_dir(path, arch=arch, ascii_replies=not plain,
                                               **({} if plain else {"template": TOOLS_CHATML}))
        return made[arch, plain]

    return folder


@pytest.fixture
def open_engine(folders, tmp_path):
    """open_engine(arch, plain=False, name="store"): an Engine on a fresh Store(block_tokens=16); closed after."""
    opened = []

    def open_(arch: str, plain: bool = False, name: str = "store", **options) -> Engine:
        store = Store(tmp_path / name, block_tokens=16)
        engine = Engine(store, tmp_path, folders(arch, plain), **options)
        opened.append((engine, store))
        return engine

    yield open_
    for engine, store in opened:
        engine.close()
        store.close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat_session(engine: Engine, name: str, text: str = "List three tools.", params=GREEDY):
    s = Session(name)
    engine.append(s, messages=[{"role": "system", "content": SYSTEM}, *user(text)])
    return s, engine.generate(s, params)


def next_logits(engine: Engine, session: Session) -> mx.array:
    """Logits for the token after the session's pending input (consumes the pending tokens)."""
    out = engine.model(mx.array(session.pending, dtype=mx.uint32)[None], cache=session.cache)
    return out[0, -1]


def slept_twins(engine: Engine) -> tuple[Session, Session]:
    """Two sessions given the same chat turn; the second slept and woke. Both then get a new user message."""
    a, first_a = chat_session(engine, "never-slept")
    b, first_b = chat_session(engine, "slept")
    assert first_a.tokens == first_b.tokens
    engine.sleep(b)
    assert b.cache is None
    b, info = engine.wake("slept")
    assert info["blocks_from_disk"] + info["blocks_from_memory"] == len(b.tokens) // 16
    assert (a.tokens, a.processed, a.messages) == (b.tokens, b.processed, b.messages)
    for s in (a, b):
        before = s.processed
        got = engine.append(s, messages=user("Now pick one."))
        assert got["prefilled"] == got["tokens"] - 1 - before  # the restored state was extended, not rebuilt
    return a, b


@pytest.mark.parametrize("arch", NAMES)
def test_wake_continues_bit_identically(open_engine, arch):
    from kvwake.daemon.config import Tuning

    # out of pages whatever the default: `slept_twins` counts the blocks read beside a hot twin, which a paged wake
    # maps (docs/decisions.md, "Paged KV in the fleet, again")
    engine = open_engine(arch, tuning=Tuning(paged_kv=False))
    a, b = slept_twins(engine)
    if arch == "gemma3_text":  # the prompt wrapped the ring buffers: a wrong restore could not hide
        window = ARCHS[arch]["sliding_window"]
        assert b.cache[0].offset > 4 * window and not can_trim_prompt_cache(b.cache)
    assert mx.array_equal(next_logits(engine, a), next_logits(engine, b))
    a, b = slept_twins(engine)
    assert engine.generate(a, GREEDY).tokens == engine.generate(b, GREEDY).tokens


@pytest.mark.parametrize("arch", NAMES)
def test_prefix_reuse_where_the_cache_cuts_or_through_restore_points_and_output_matches_cold(open_engine, arch):
    engine = open_engine(arch)
    assert engine.cuttable == (arch in CUTTABLE)
    first, _ = chat_session(engine, "first")
    engine.sleep(first)
    second = Session("second")
    got = engine.append(second, messages=[{"role": "system", "content": SYSTEM}, *user("Pick a tool.")])
    # the others through a restore point: the one at the block boundary before the user message
    assert got["reused"] >= 16 and got["reused"] + got["prefilled"] == got["tokens"] - 1
    assert arch in CUTTABLE or got["reused"] % 16 == 0
    cold_engine = open_engine(arch, name="cold")
    cold = Session("cold")
    got_cold = cold_engine.append(cold, messages=[{"role": "system", "content": SYSTEM}, *user("Pick a tool.")])
    assert got_cold["reused"] == 0 and cold.tokens == second.tokens
    assert engine.generate(second, GREEDY).tokens == cold_engine.generate(cold, GREEDY).tokens


@pytest.mark.parametrize("arch", NAMES)
def test_warm_pins_a_prompt_that_new_sessions_reuse(open_engine, arch):
    engine = open_engine(arch)
    system = [{"role": "system", "content": SYSTEM}]
    warmed = engine.warm(messages=system)
    # the prompt's last partial block is stored too, as a short block (the others reuse up to a restore point,
    # whose full blocks were written with it as the warm's prefill passed it), all of them pinned
    short = warmed["tokens"] % 16 > 0
    assert warmed["blocks"] >= 2 and warmed["new_blocks"] == (warmed["blocks"] if arch in CUTTABLE else 0) + short
    assert engine.store.rows("SELECT count(*) AS n FROM blocks WHERE pins = 1")[0]["n"] == warmed["blocks"] + short
    s = Session("s")
    got = engine.append(s, messages=[*system, *user("Pick a tool.")])
    assert got["reused"] >= 16 and (arch in CUTTABLE or got["reused"] % 16 == 0)
    cold_engine = open_engine(arch, name="cold")
    cold = Session("cold")
    cold_engine.append(cold, messages=[*system, *user("Pick a tool.")])
    assert engine.generate(s, GREEDY).tokens == cold_engine.generate(cold, GREEDY).tokens


@pytest.mark.parametrize("arch", [n for n in NAMES if n not in CUTTABLE])
def test_divergence_rebuilds_an_uncuttable_cache_from_a_point_and_matches_a_fresh_session(open_engine, arch):
    engine = open_engine(arch, plain=True)
    # A plain model's replies hold bytes >= 128 that decode to U+FFFD: re-rendered, the reply is other tokens.
    s, reply = chat_session(engine, "s", "hi", GREEDY)
    rendered = engine.template.render(s.messages + user("again"))
    assert common_prefix(s.tokens, rendered) < len(s.tokens), "precondition: the re-render must diverge"
    parting, prompt = common_prefix(s.tokens, rendered), len(s.tokens) - len(reply.tokens)
    got = engine.append(s, messages=user("again"))
    # rebuilt from the last restore point before the parting token (kv/points.py: the first prompt's last
    # block boundary; its reply crossed none), the rest prefilled
    assert got["reused"] == (prompt - 1) // 16 * 16 <= parting
    assert got["prefilled"] == got["tokens"] - 1 - got["reused"] and len(rendered) == got["tokens"]
    fresh = Session("fresh")
    engine.append(fresh, messages=s.messages)
    assert fresh.tokens == s.tokens
    assert mx.array_equal(next_logits(engine, s), next_logits(engine, fresh))
    s, _ = chat_session(engine, "s2", "hi", GREEDY)
    engine.append(s, messages=user("again"))
    fresh = Session("fresh2")
    engine.append(fresh, messages=s.messages)
    assert engine.generate(s, GREEDY).tokens == engine.generate(fresh, GREEDY).tokens


@pytest.mark.parametrize("arch", NAMES)
def test_generating_twice_without_input(open_engine, arch):
    engine = open_engine(arch)
    a, b = Session("a"), Session("b")
    for s in (a, b):
        engine.append(s, text="Once upon a time there was a")
        engine.generate(s, GenerateParams(max_tokens=6))
    if arch in CUTTABLE:  # the last token is trimmed and fed again: as if generated in one call
        second = engine.generate(a, GenerateParams(max_tokens=6))
        once = Session("once")
        engine.append(once, text="Once upon a time there was a")
        whole = engine.generate(once, GenerateParams(max_tokens=12))
        assert a.tokens == once.tokens and second.tokens == whole.tokens[6:]
        return
    assert not can_trim_prompt_cache(a.cache)
    with pytest.raises(InvalidParamsError, match="append"):
        engine.generate(a, GenerateParams(max_tokens=6))
    # The refused call changed nothing: the session goes on exactly like its twin.
    assert (a.tokens, a.processed) == (b.tokens, b.processed)
    for s in (a, b):
        engine.append(s, text=" and then")
    assert mx.array_equal(next_logits(engine, a), next_logits(engine, b))


def tool_twins(engine: Engine, sleep_between: bool) -> tuple[Session, Session]:
    """Two sessions given tools and the same chat turn; the second slept and woke when asked."""
    a, b = Session("a"), Session("b")
    for s in (a, b):
        engine.append(s, messages=[{"role": "system", "content": "Use tools."}, *user("Weather in Paris?")],
                      tools=TOOLS)
        engine.generate(s, GREEDY)
    if sleep_between:
        engine.sleep(b)
        b, _ = engine.wake("b")
    return a, b


@pytest.mark.parametrize("arch", NAMES)
def test_tools_are_rendered_and_stay_with_the_session(open_engine, arch):
    engine = open_engine(arch)
    a, _ = tool_twins(engine, sleep_between=False)
    assert engine.tokenizer.decode(a.tokens).startswith("TOOLS:" + json.dumps(TOOLS) + "\n<|im_start|>system\n")
    before = a.processed
    got = engine.append(a, messages=user("And in Rome?"))  # no tools given: the session's own stay
    assert got["prefilled"] == got["tokens"] - 1 - before
    assert engine.tokenizer.decode(a.tokens).startswith("TOOLS:" + json.dumps(TOOLS) + "\n")


# -- regressions: bugs found here, fixed in the engine and store --------------------------------


@pytest.mark.parametrize("bad", [
    {"messages": [{"role": "user", "content": "hi", "name": b"bytes from msgpack bin"}]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "t", 1: "int key"}]},
], ids=["bytes-in-message", "mixed-keys-in-tools"])
def test_input_a_snapshot_cannot_hold_is_refused_up_front(open_engine, bad):
    # Was: accepted, then every sleep of the session failed with a TypeError (it could never be saved).
    engine = open_engine("llama")
    s = Session("s")
    with pytest.raises(InvalidParamsError, match="plain JSON"):
        engine.append(s, **bad)
    assert s.tokens == [] and s.messages == []


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_tools_survive_sleep_and_the_next_turn_matches_the_never_slept_twin(open_engine, arch):
    # Was: metadata stored with sorted keys, so woken tools rendered in another order than cached.
    engine = open_engine(arch)
    a, b = tool_twins(engine, sleep_between=True)
    for s in (a, b):
        before = s.processed
        got = engine.append(s, messages=user("And in Rome?"))
        assert got["prefilled"] == got["tokens"] - 1 - before
    assert a.tokens == b.tokens
    assert mx.array_equal(next_logits(engine, a), next_logits(engine, b))
