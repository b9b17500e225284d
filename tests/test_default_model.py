"""End to end on the real default model (SmolLM2-135M-Instruct): short prompts, it is slow here."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.model.convert import DEFAULT_MODEL_NAME
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.store import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory, converted):
    data = tmp_path_factory.mktemp("data")
    # The session's conversion (tests/conftest.py; tests/test_convert.py checks it), linked where the daemon
    # keeps the default model: the engine finds it made, as after its first start, and converts nothing.
    shutil.copytree(converted, data / "models" / DEFAULT_MODEL_NAME, copy_function=os.link)
    store = Store(data / "store", block_tokens=16)
    # no model: the default (where the wheel is not installed, `converted` skips); out of pages whatever the
    # default: the wake below counts the blocks read beside its hot twin, which a paged wake maps
    e = Engine(store, data, tuning=Tuning(paged_kv=False))
    yield e
    e.close()
    store.close()


def test_default_model_answers_and_wakes_exactly(engine):
    assert engine.model_name == "SmolLM2-135M-Instruct" and engine.cuttable
    a, b = Session("a"), Session("b")
    for s in (a, b):
        engine.append(s, messages=[{"role": "system", "content": "Answer in one word."},
                                   {"role": "user", "content": "What is the capital of France?"}])
    answer = engine.generate(a, GenerateParams(max_tokens=8))
    assert "Paris" in answer.text
    assert engine.generate(b, GenerateParams(max_tokens=8)).tokens == answer.tokens
    engine.sleep(b)
    b, info = engine.wake("b")
    assert info["tokens"] == len(a.tokens) and info["blocks_from_disk"] == len(a.tokens) // 16
    for s in (a, b):
        engine.append(s, messages=[{"role": "user", "content": "And of Italy?"}])
    logits_a = engine.model(mx.array(a.pending)[None], cache=a.cache)[0, -1]
    logits_b = engine.model(mx.array(b.pending)[None], cache=b.cache)[0, -1]
    assert mx.array_equal(logits_a, logits_b)
