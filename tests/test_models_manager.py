"""Several models in one session manager (issue 53): one memory budget (every engine's KV room counts every
loaded model's weights, a load counts the hot KV too, a model of unknown size is refused, a pinned set over
the budget fails the start), an imported snapshot on its bundle's model. Two tiny models, a session manager
without a daemon (one daemon for the start's check)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.model import budget, memory
from kvwake.daemon.model.budget import ModelsBudgetError
from testkit.daemon import Daemon
from testkit.models import manager_on, stop_manager, two_tiny_models

SYSTEM = "You are a careful agent. Answer briefly. " * 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return two_tiny_models(tmp_path_factory.mktemp("models"))


def rooms(manager) -> dict[str, tuple[int, int, int | None]]:
    return {m.name: (m.engine.kv_room_bytes, m.engine.hot_budget_bytes, m.engine.session_tokens)
            for m in manager.models}


async def test_the_first_models_kv_room_shrinks_by_the_seconds_weights_and_grows_back(tmp_path, models):
    # Was: each engine's KV room was the memory limit less its own weights alone, so two models together
    # planned a second model's weights more KV than the device holds.
    manager, store = manager_on(tmp_path, models)
    try:
        main = manager.models.get("main").engine
        whole = memory.kv_room(main.limits, 0)
        alone = rooms(manager)["main"]
        assert alone[0] == whole - main.weights_bytes
        small = (await asyncio.wait_for(manager.ensure("small"), 60)).engine
        both = whole - main.weights_bytes - small.weights_bytes
        assert main.kv_room_bytes == small.kv_room_bytes == both < alone[0]
        assert main.hot_budget_bytes == int(memory.HOT_SHARE * both) < alone[1]
        assert main.session_tokens == memory.tokens_in(both, main.token_bytes)
        # on CUDA the most tokens whose buffer fits: a buffer grows in steps of up to a sixteenth of its tokens
        # (kv/capacity.py), one a tiny model's weights may not cross (the H200's room: 419430400 tokens either way)
        assert main.session_tokens < alone[2] or kvcapacity.installed() and main.session_tokens == alone[2]
        await asyncio.wait_for(manager.unload("small"), 60)
        assert rooms(manager)["main"] == alone
    finally:
        stop_manager(manager, store)


async def test_a_load_counts_the_hot_kv_and_sleeps_idle_sessions_before_it_unloads_a_model(tmp_path, models):
    # Was: the models budget counted weights only: a load beside hot sessions passed it by their KV.
    manager, store = manager_on(tmp_path, models)
    try:
        await manager.create("s", SYSTEM)
        await manager.append("s", messages=[{"role": "user", "content": "hello"}])
        hot = manager.hot_bytes()
        small_weights = budget.weights_on_disk(str(models[1]), tmp_path)
        weights = manager.weights_loaded() + small_weights
        assert hot > 0
        manager.settings = dataclasses.replace(manager.settings, models_budget_bytes=weights + hot // 2)
        manager.fit_rooms()
        await asyncio.wait_for(manager.ensure("small"), 60)
        assert manager.models.names() == ["main", "small"]  # the session slept: no model had to go
        assert manager.entries["s"].session is None and manager.counters["room_sleeps"] == 1
        assert manager.weights_loaded() + manager.hot_bytes() <= manager.budget()
    finally:
        stop_manager(manager, store)


def test_a_model_whose_weights_cannot_be_measured_is_refused_with_its_folder(tmp_path):
    folder = tmp_path / "npz-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "weights.npz").write_bytes(b"0" * 64)
    with pytest.raises(ModelsBudgetError, match=r"no \*\.safetensors in .*npz-model: the size of its weights"):
        budget.weights_on_disk(str(folder), tmp_path)


async def test_a_model_bigger_than_the_whole_budget_is_refused_naming_both(tmp_path, models):
    manager, store = manager_on(tmp_path, models)
    try:
        small_weights = budget.weights_on_disk(str(models[1]), tmp_path)
        manager.settings = dataclasses.replace(manager.settings, models_budget_bytes=small_weights - 1)
        with pytest.raises(ModelsBudgetError, match=r"model 'small''s weights do not fit the memory budget: "
                                                    r"small [0-9.]+ [kMG]?B of weights > "):
            await manager.ensure("small")
        assert manager.models.names() == ["main"]  # nothing unloaded for a load that cannot fit
    finally:
        stop_manager(manager, store)


def test_a_pinned_set_over_the_budget_fails_the_start_with_the_figures(tmp_path, models):
    main, small = models
    sizes = [(m / "model.safetensors").stat().st_size for m in models]
    limit = sum(sizes) // 2  # either model alone fits, not both
    (tmp_path / "none.toml").write_text(f"models_budget_bytes = {limit}\n[models]\n"
                                        f'main = {{path = "{main}"}}\nsmall = {{path = "{small}", pinned = true}}\n')
    d = Daemon(tmp_path, main)
    with pytest.raises(RuntimeError, match="daemon exited 2"):
        d.start()
    said = d.log.read_text()
    assert "the default and pinned models do not fit the memory budget: main " in said
    assert f"small {budget.gb(sizes[1])} = " in said and f"of weights > {budget.gb(limit)}" in said


async def exported_small_session(manager, path) -> dict:
    """Session "s" made on small, one message appended, slept and exported to `path`: its sleep's reply."""
    async with manager.use("small"):
        await manager.create("s", SYSTEM)
    await manager.append("s", messages=[{"role": "user", "content": "hello"}])
    slept = await manager.sleep("s")
    manager.store.export(slept["snapshot_id"], path)
    return slept


async def test_an_imported_snapshot_belongs_to_the_model_its_bundle_names(tmp_path, models):
    # Was: an imported session was attributed to the default model until a restart read its bundle.
    manager, store = manager_on(tmp_path, models)
    try:
        slept = await exported_small_session(manager, tmp_path / "s.kvwake")
        await manager.import_snapshot(str(tmp_path / "s.kvwake"), "copy")
        assert manager.model_of(manager.entries["copy"]) == "small"
        woken = await manager.wake("copy")  # on small: no bundle mismatch
        assert woken["tokens"] == slept["tokens"] + slept["pending"]
    finally:
        stop_manager(manager, store)


async def test_each_models_sessions_are_counted_without_walking_every_session(tmp_path, models):
    # Was: status's counts per model and the in-use check before an unload walked every session known.
    from kvwake.daemon.sessions.entries import Entry

    manager, store = manager_on(tmp_path, models)
    try:
        async with manager.use("small"):
            await manager.create("a", SYSTEM)
        await manager.create("b", SYSTEM)
        await manager.create("c", SYSTEM)
        await manager.sleep("c")
        for i in range(2000):  # stored conversations of small, asleep, as a start knows them
            manager.entries[f"old{i}"] = Entry(f"old{i}", model="small")
        manager.entries.values = manager.entries.items = None  # a walk of every session fails from here
        sessions = {m["name"]: m["sessions"] for m in manager.model_states()}
        assert sessions == {"main": {"hot": 1, "asleep": 1}, "small": {"hot": 1, "asleep": 2000},
                            "third": {"hot": 0, "asleep": 0}}
        assert not manager._in_use("small")
        async with manager.claim("old7", "sleep"):  # a claim of an asleep session, outside any use of small
            assert manager._in_use("small") and not manager._in_use("main")
        assert not manager._in_use("small")
        await manager.delete("old8")
        assert manager.model_states()[1]["sessions"] == {"hot": 1, "asleep": 1999}
    finally:
        stop_manager(manager, store)


async def test_an_imported_session_of_a_model_not_loaded_here_yet_moves_to_it_at_its_first_load(tmp_path, models):
    # Was: a snapshot whose bundle no model had had here stayed the default model's (its wake refused) for good.
    there, there_store = manager_on(tmp_path / "there", models)
    try:
        slept = await exported_small_session(there, tmp_path / "s.kvwake")
    finally:
        stop_manager(there, there_store)
    manager, store = manager_on(tmp_path / "here", models)  # small never loaded here
    try:
        await manager.import_snapshot(str(tmp_path / "s.kvwake"), "s")
        assert manager.model_of(manager.entries["s"]) == "main"  # its bundle unknown here until small loads
        await asyncio.wait_for(manager.ensure("small"), 60)
        assert manager.model_of(manager.entries["s"]) == "small"
        assert {m["name"]: m["sessions"]["asleep"] for m in manager.model_states()} == {"main": 0, "small": 1,
                                                                                        "third": 0}
        woken = await manager.wake("s")
        assert woken["tokens"] == slept["tokens"] + slept["pending"]
    finally:
        stop_manager(manager, store)
