"""The manager orchestrates, the engine computes: models from the provider, each check once per request, a
wake's snapshot read once (in process: real engine, real engine thread, real store)."""

from __future__ import annotations

import time

import pytest

from kvwake.daemon.fronts.http import Api
from kvwake.daemon.fronts.openai_shapes import ChatRequest
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.provider import LoadedModel, ModelProvider
from kvwake.errors import NotFoundError
from tests.test_manager import SYSTEM, manager, model_dir  # noqa: F401 - fixtures

CHAT = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}


def test_the_provider_serves_its_models_by_name_and_the_thread_runs_their_steps(manager):
    models, model = manager.models, manager.model
    assert models.names() == [model.name] and models.get() is model and models.get(model.name) is model
    assert model.bundle is model.engine.bundle and model.tokenizer is model.engine.tokenizer
    assert manager.model_names() == [model.name]
    # attached: the engine thread steps this engine's decoder and takes its planner's jobs
    assert model.thread.scheduler.decoder is model.engine.decoder
    assert model.engine.planner.idle == model.thread.idle and model.engine.planner.later == model.thread.later
    with pytest.raises(NotFoundError, match=f"model 'other' is not loaded; loaded: {model.name}"):
        models.get("other")
    with pytest.raises(ValueError, match="loaded already"):
        models.add(model.engine, model.thread)
    with pytest.raises(NotFoundError, match="no model is loaded"):
        ModelProvider().get()
    assert isinstance(model, LoadedModel) and list(models) == [model]


async def test_a_front_request_is_checked_and_rendered_once(manager, monkeypatch):
    """A front's request: its params checked once, its prompt rendered once, its length checked once, however
    many steps it goes through (prepare, match, claim, append, start the call)."""
    from kvwake.daemon.sessions.matching import Matcher

    engine, calls = manager.engine, {"params": 0, "fits": 0, "render": 0}
    counted = {"params": (manager, "check_params"), "fits": (engine, "check_fits"), "render": (engine, "render")}
    for name, (owner, attr) in counted.items():
        real = getattr(owner, attr)
        monkeypatch.setattr(owner, attr, lambda *a, _n=name, _r=real, **k: calls.__setitem__(_n, calls[_n] + 1)
                            or _r(*a, **k))
    matcher = Matcher(manager)
    for named in (None, "named", None):
        calls.update(params=0, fits=0, render=0)
        prepared = await manager.prepare(CHAT, GenerateParams(max_tokens=2))
        session, task = await matcher.start(prepared, named, None, None, lambda: False)
        assert (await task)["tokens"] and session["session_id"] in manager.entries
        assert calls == {"params": 1, "fits": 1, "render": 1}, (named, calls)


async def test_an_rpc_chat_checks_its_input_once(manager, monkeypatch):
    engine, fits = manager.engine, []
    real = engine.check_fits
    monkeypatch.setattr(engine, "check_fits", lambda tokens: fits.append(tokens) or real(tokens))
    await manager.create("s", SYSTEM)
    got = await manager.generate("s", GenerateParams(max_tokens=2), None, lambda: False,
                                 {"messages": [{"role": "user", "content": "hi"}]})
    assert got["tokens"] and len(fits) == 1


async def test_a_wake_reads_its_snapshot_once_and_before_it_makes_room(manager, monkeypatch):
    await manager.create("s", SYSTEM)
    await manager.append("s", messages=[{"role": "user", "content": "hi"}])
    await manager.sleep("s")
    store, reads, order = manager.store, [], []
    for name in ("snapshot", "latest_snapshot", "snapshot_summary"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *a, _n=name, _r=real, **k: reads.append(_n) or _r(*a, **k))
    real_room = manager.make_room
    monkeypatch.setattr(manager, "make_room", lambda *a, **k: order.append(list(reads)) or real_room(*a, **k))
    info = await manager.wake("s")
    assert info["tokens"] > 0 and reads == ["snapshot"], reads
    assert order == [["snapshot"]]  # verified (bundle included) before any session is slept for it


async def test_a_warm_looks_up_the_stored_prefix_once(manager, monkeypatch):
    """Was: the manager's `_prefix` asked the store, and Engine.warm asked it again when that found nothing."""
    engine, asked = manager.engine, []
    real = engine.stored_prefix
    monkeypatch.setattr(engine, "stored_prefix", lambda *a, **k: asked.append(1) or real(*a, **k))
    info = await manager.warm(CHAT)
    assert info["tokens"] > 0
    assert len(asked) == 1, f"the stored prefix was looked up {len(asked)} times for one warm"


async def test_an_http_turns_render_ms_is_the_render_alone(manager, monkeypatch):
    """status.turns' render_ms is the render alone. Was: it held the params check too (a slow grammar's compile
    read as render time)."""
    real = manager.check_params
    monkeypatch.setattr(manager, "check_params", lambda *a, **k: time.sleep(0.3) or real(*a, **k))
    api = Api(manager)
    req = ChatRequest.parse({**CHAT, "max_tokens": 2}, None)
    session, task = await api._start(req, None, lambda: False)
    await task
    turn = manager.turns[-1]
    assert turn["render_ms"] < 250, turn
