"""Review of issue 49's refactor: behaviour that changed against 4469ee7 (each docstring says what it did there)."""

from __future__ import annotations

import time

from kvwake.daemon.fronts.http import Api
from kvwake.daemon.fronts.openai_shapes import ChatRequest
from tests.test_manager import SYSTEM, manager, model_dir  # noqa: F401 - fixtures

PROMPT = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}


async def test_a_warm_looks_up_the_stored_prefix_once(manager, monkeypatch):
    """Before: Engine.warm -> append -> prefix_cache asked `shared` (the hot copy), then the store, once.
    After: the manager's `_prefix` asks the store, and Engine.warm asks it again when that found nothing."""
    engine, asked = manager.engine, []
    real = engine.stored_prefix
    monkeypatch.setattr(engine, "stored_prefix", lambda *a, **k: asked.append(1) or real(*a, **k))
    info = await manager.warm(PROMPT)
    assert info["tokens"] > 0
    assert len(asked) == 1, f"the stored prefix was looked up {len(asked)} times for one warm"


async def test_an_http_turns_render_ms_is_the_render_alone(manager, monkeypatch):
    """status.turns' render_ms was the render alone (the params check ran before the clock started, the fit
    check counted in match_ms); after, it holds the params check too."""
    real = manager.check_params
    monkeypatch.setattr(manager, "check_params", lambda *a, **k: time.sleep(0.3) or real(*a, **k))
    api = Api(manager)
    req = ChatRequest.parse({**PROMPT, "max_tokens": 2}, None)
    session, task = await api._start(req, None, lambda: False)
    await task
    turn = manager.turns[-1]
    assert turn["render_ms"] < 250, turn
