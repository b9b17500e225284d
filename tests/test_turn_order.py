"""Turns one at a time (model/scheduler/turns.py): where turns do not pack (the CPU's default), turns that come
together each prefill to their first token before the next one's prefill starts (in process: real engine,
real engine thread, the session manager's turns as the fronts make them)."""

from __future__ import annotations

import asyncio

import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.model import packing
from kvwake.daemon.model.generation import GenerateParams, TextOutput
from kvwake.daemon.model.scheduler import slices
from kvwake.daemon.model.decoder import Decoder
from tests.test_arrivals import chat
from tests.test_manager import SYSTEM, managed, model_dir  # noqa: F401 - fixtures

TURNS = 4


@pytest.fixture
def manager(model_dir, tmp_path):  # noqa: F811 - turns one at a time on any machine (the CPU's default)
    yield from managed(model_dir, tmp_path, Tuning(pack_prefill=False))


def record_engine(monkeypatch) -> list[tuple[str, str]]:
    """The engine thread's events in order: ("prefill", session id) for each prefill slice computed (alone or
    packed: every session of it), ("first", session id) when a call's first token is sampled."""
    events: list[tuple[str, str]] = []
    owners: dict[int, str] = {}  # id(a call's output) -> its session's id
    step, join, add = slices.Chunk.step, Decoder.join, TextOutput.add

    def recorded_step(chunk: slices.Chunk) -> None:
        if not chunk.done and chunk.failed is None:
            events.extend(("prefill", s.id) for s, _ in chunk.rows)
        step(chunk)

    def recorded_join(decoder: Decoder, call) -> None:
        owners[id(call.output)] = call.session.id
        join(decoder, call)

    def recorded_add(output: TextOutput, token: int):
        if output.first is None and id(output) in owners:
            events.append(("first", owners[id(output)]))
        return add(output, token)

    monkeypatch.setattr(slices.Chunk, "step", recorded_step)
    monkeypatch.setattr(Decoder, "join", recorded_join)
    monkeypatch.setattr(TextOutput, "add", recorded_add)
    return events


async def test_turns_that_come_together_each_reach_their_first_token_before_the_next_prefills(manager,
                                                                                                monkeypatch):
    """Was: the engine took the turns' jobs as they were queued, the first chunk of every turn, then the rest
    of every turn (or, packed, one pass for all four): every first token came after all four prefills."""
    assert manager.thread.scheduler.turns is not None  # turns do not pack: they go one at a time
    params, replies = GenerateParams(max_tokens=4), []
    for i in range(TURNS):  # each session's first turn alone: each keeps its cache
        await manager.create(f"s{i}", SYSTEM)
        prepared = await manager.prepare(chat(i), params)
        replies.append((await manager.generate(f"s{i}", params, None, lambda: False, prepared))["text"])
    nexts = [{"messages": chat(i)["messages"] + [{"role": "assistant", "content": replies[i]},
                                                 {"role": "user", "content": f"now run suite {i} again " * 40}]}
             for i in range(TURNS)]
    prepared = [await manager.prepare(nexts[i], params) for i in range(TURNS)]
    events = record_engine(monkeypatch)
    results = await asyncio.gather(*(manager.generate(f"s{i}", params, None, lambda: False, prepared[i])
                                     for i in range(TURNS)))
    assert all(r["tokens"] for r in results)
    # Each turn's span, from its first prefill slice to its first token, overlaps no other turn's.
    spans = {}
    for at, (kind, session) in enumerate(events):
        first, last = spans.get(session, (at, at))
        spans[session] = (first, at if kind == "first" else last)
    assert {kind for kind, _ in events} == {"prefill", "first"} and len(spans) == TURNS, events
    ordered = sorted(spans.values())
    assert all(a[1] < b[0] for a, b in zip(ordered, ordered[1:])), events
    assert all(events[end] == ("first", s) for s, (_, end) in spans.items()), events


async def test_a_turn_that_fails_before_its_call_lets_the_next_turn_go(manager, monkeypatch):
    """A turn whose call cannot be made (here: its output fails to build) lands in its generate's end; the
    turn after it prefills at once, not after the quiet time."""
    params = GenerateParams(max_tokens=2)
    for i in range(2):
        await manager.create(f"s{i}", SYSTEM)
    prepared = [await manager.prepare(chat(i), params) for i in range(2)]
    real = manager._call_for
    calls = []

    def failing_first(session, *args):
        calls.append(session.id)
        if len(calls) == 1:
            raise ValueError("no call for this turn")
        return real(session, *args)

    monkeypatch.setattr(manager, "_call_for", failing_first)
    results = await asyncio.gather(*(manager.generate(f"s{i}", params, None, lambda: False, prepared[i])
                                     for i in range(2)), return_exceptions=True)
    assert sum(isinstance(r, ValueError) for r in results) == 1
    assert sum(isinstance(r, dict) and bool(r["tokens"]) for r in results) == 1
    turns = manager.thread.timing()["turns"]
    assert turns["let_go"] == 0, turns  # the failed turn ended by landing, not by its quiet time


def test_a_model_that_cannot_pack_where_packing_pays_keeps_its_turns_as_they_come(model_dir, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    """One at a time is for where a pass costs its tokens (packing.wanted false), not for a model that cannot
    pack on a GPU (a recurrent one): there its turns' jobs stay as they come, and no decoding stream waits for
    another turn's prefill. Was: any model whose turns did not pack went one at a time."""
    monkeypatch.setattr(packing, "wanted", lambda configured=None: True if configured is None else configured)
    monkeypatch.setattr(packing, "packable_model", lambda model: False)
    for m in managed(model_dir, tmp_path, Tuning()):
        assert m.engine.planner.pack_prefill is False and m.thread.scheduler.turns is None
    for m in managed(model_dir, tmp_path / "off", Tuning(pack_prefill=False)):  # asked for: one at a time
        assert m.thread.scheduler.turns is not None
