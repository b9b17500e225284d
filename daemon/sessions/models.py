"""Several models in one daemon: which one an operation runs on, loads on demand, unloads without loss.

Part of the session manager (`SessionManager` in sessions/manager.py takes these methods); the design is in
docs/decisions.md, "Several models (issue 53)".

- **The model of an operation** is the context variable `CURRENT`: a front sets it from a request's `model`
  (`using`), a claim sets it to the claimed session's model (`model_scope`), and the manager's `engine`,
  `thread` and `model` answer for it. Tasks and worker threads started inside inherit it.
- **Load on demand:** `use` waits for a model's load (one load per model at a time, shared by whoever
  asks), which runs `start` on a worker thread: the weights are read on the model's own new engine thread.
  Meanwhile the blocks of the asleep sessions whose operations wait for it are read into the RAM tier its
  engine takes (sessions/read_ahead.py), so their wakes after the load take them from memory.
  Before a load, room is made (sessions/model_room.py) while the load would go past `max_loaded` or the
  memory budget (model/budget.py: every loaded model's weights and hot KV): idle sessions sleep, models are
  unloaded least recently used first; a model in use is waited for; pinned ones are never unloaded. After
  each load and unload every engine's KV room is what the budget leaves beside all the loaded weights.
- **Unload without loss:** new operations on the model wait; once none is in flight, each of its hot
  sessions sleeps, then its engine stops. Its sessions stay known, asleep, and wake on its next load.
- **Sessions know their model** after a restart by their head snapshot's bundle hash, through
  `<data dir>/model-bundles.json` (bundle hash -> model name), written at each load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from anyio import to_thread

from kvwake.daemon.model.budget import ModelsBudgetError
from kvwake.daemon.model import weights
from kvwake.daemon.model.loader import free_stopped, stop_model, warm_model
from kvwake.daemon.model.provider import LoadedModel
from kvwake.daemon.model.registry import ModelSpec, Registry
from kvwake.daemon.sessions.entries import Entry
from kvwake.daemon.sessions.model_room import WAIT_S, ModelRoom
from kvwake.daemon.sessions.read_ahead import WAKING_OPS, ReadAhead
from kvwake.errors import BusyError, InvalidParamsError, KvwakeError
from kvwake.store.files import write_durable

__all__ = ["CURRENT", "BUNDLES_FILE", "ModelKeeping", "ModelLoadError", "read_bundles"]

log = logging.getLogger("kvwake.models")
CURRENT: ContextVar[str | None] = ContextVar("kvwake_model", default=None)  # the model of the operation in hand
HELD: ContextVar[frozenset[str]] = ContextVar("kvwake_models_held", default=frozenset())  # its `use`s, outer ones
BUNDLES_FILE = "model-bundles.json"
BUILD_POLL_S = 0.25  # how often an unloaded model's modules, to build ahead, look for no model in use
# (spec, ram_tier=the RAM tier its engine takes or None) -> (engine, engine thread), blocking (model/loader.py)
Starter = Callable[..., tuple[Any, Any]]


class ModelLoadError(KvwakeError):
    """A model could not be loaded (INTERNAL: the daemon serves on, its other models unaffected)."""


class ModelKeeping(ModelRoom):
    """The session manager's models (see the module docstring); `SessionManager` holds the state."""

    def is_loaded(self, name: str) -> bool:
        """Whether model `name` is loaded now (a front asks before it waits for a load)."""
        return name in self.models

    def _init_models(self, registry: Registry, start: Starter | None) -> None:
        self.registry, self._start = registry, start
        self._loads: dict[str, asyncio.Task] = {}
        self._warming: dict[str, asyncio.Task] = {}  # warm-ups of models loaded on demand, by model
        self._loading_since: dict[str, float] = {}
        self._load_ms: dict[str, float] = {}  # each model's last load on demand: its start to its serving, ms
        self._unloads: dict[str, asyncio.Task] = {}  # each model's unload in progress, shared by whoever asks
        self._building: dict[str, asyncio.Task] = {}  # unloaded models' modules waiting to be built ahead
        self._draining: set[str] = set()  # the model a waiting load unloads next: new operations on it wait
        self._uses: Counter[str] = Counter()  # operations running on each model
        self._waits: Counter[str] = Counter()  # operations waiting for each model's load
        self._blocked: Counter[str] = Counter()  # of those, the ones held back by its unload or its draining
        self._last_use: dict[str, float] = {}
        self._weights: dict[str, int] = {}  # each model's weights as measured at its last load
        self._admit: asyncio.Lock | None = None  # made on the loop: one load's room-making at a time
        self._limits = self.models.get().engine.limits  # MLX's, process-wide: every model's engine has them
        self._bundles_path = Path(self.settings.data_dir) / BUNDLES_FILE
        self._bundles: dict[str, str] = read_bundles(self._bundles_path)
        self._unbound: dict[str, set[str]] = {}  # bundle no model has had here -> its sessions (model_for_stored)
        self.read_ahead = ReadAhead(self.store)  # the blocks of the sessions a load waits for
        for model in self.models:
            self._loaded(model)
        self.fit_rooms()

    # -- which model ----------------------------------------------------------

    def model_name(self) -> str:
        """The name of the model the operation in hand runs on: its scope's, else the default one."""
        return CURRENT.get() or self.registry.default.name

    def model_of(self, entry: Entry) -> str:
        return entry.model if entry.model is not None else self.registry.default.name

    def model_for_bundle(self, bundle: str | None) -> str:
        """The model whose bundle hash is `bundle` (a stored session's), else the default one."""
        name = self._bundles.get(bundle or "")
        return name if name is not None and name in self.registry.specs else self.registry.default.name

    def model_for_stored(self, session_id: str, bundle: str | None) -> str:
        """The model of stored session `session_id`, its head's bundle `bundle` (`model_for_bundle`). A bundle
        no model has had here yet (an imported snapshot's, say) is noted: its sessions, attributed to the
        default model meanwhile, move to the model that first loads with it (`_bind_noted`)."""
        if bundle is not None and bundle not in self._bundles:
            self._unbound.setdefault(bundle, set()).add(session_id)
        return self.model_for_bundle(bundle)

    async def bind_imported(self, session_id: str, snapshot_id: str) -> Entry:
        """The entry of a session an import made known (asleep), on the model its snapshot's bundle names
        (`model_for_stored`); a session known already keeps its entry."""
        bundle = (await to_thread.run_sync(self.store.snapshot_summary, snapshot_id))["bundle"]
        if session_id not in self.entries:
            self.entries[session_id] = Entry(session_id, model=self.model_for_stored(session_id, bundle))
        return self.entries[session_id]

    def _bind_noted(self, model: LoadedModel) -> None:
        """On the loop, a model just loaded: the sessions noted with its bundle move to it (asleep and idle
        ones; one claimed now keeps its model, and stays noted for a later load)."""
        for sid in self._unbound.pop(model.bundle.hash, set()):
            entry = self.entries.get(sid)
            if entry is not None and (entry.busy or entry.session is not None):
                self._unbound.setdefault(model.bundle.hash, set()).add(sid)
            elif entry is not None and entry.model != model.name:
                self.entries.rebind(entry, model.name)

    @contextlib.asynccontextmanager
    async def using(self, requested: Any) -> AsyncIterator[LoadedModel]:
        """For a front's request naming `requested` (None: the default model): the model it resolves to,
        loaded, its operations running on it meanwhile. UnknownModelError if no model answers to it."""
        async with self.use(self.registry.resolve(requested).name) as model:
            yield model

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[LoadedModel]:
        """Model `name` loaded (waiting for its load, or its unload and then a load) and kept loaded while
        the block runs, the operation's model meanwhile (`CURRENT`). Counted as waiting from the start, so
        a model loaded for it is not unloaded for another load before it runs. Within a `use` of the same
        model (an HTTP turn making its session, a claim inside a request) it does not wait: the outer one keeps
        the model loaded, and an unload asked meanwhile waits for that one, which would wait for this one."""
        held = HELD.get()
        if name in held:
            model = self.models.get(name)
        else:
            self._waits[name] += 1
            try:
                model = await self.ensure(name)
            finally:
                self._waits[name] -= 1
        self._uses[name] += 1  # no await since `ensure` returned: no unload began in between
        tokens = CURRENT.set(name), HELD.set(held | {name})
        self._last_use[name] = time.monotonic()
        try:
            yield model
        finally:
            CURRENT.reset(tokens[0])
            HELD.reset(tokens[1])
            self._uses[name] -= 1
            self._last_use[name] = time.monotonic()

    def staying(self, name: str) -> bool:
        """Whether model `name` is loaded and not being unloaded."""
        return name in self.models and name not in self._unloads and name not in self._draining

    @contextlib.contextmanager
    def scoped(self, name: str):  # noqa: ANN201 - a context manager
        """Inside: model `name` is the operation's (`engine`, `thread` and `model` answer for it)."""
        token = CURRENT.set(name)
        try:
            yield
        finally:
            CURRENT.reset(token)

    def reading_ahead(self, entry: Entry, op: str) -> contextlib.AbstractContextManager:
        """For a claim of `entry` for `op`: where the operation wakes the session (asleep) after its model's load
        (not loaded, or going), its blocks are read beside the load while it waits (sessions/read_ahead.py)."""
        name = self.model_of(entry)
        if op not in WAKING_OPS or entry.session is not None or self.staying(name):
            return contextlib.nullcontext()
        return self.read_ahead.waiting(name, entry.id)

    @contextlib.contextmanager
    def model_scope(self, entry: Entry, op: str):  # noqa: ANN201 - a context manager
        """The claimed entry's model as the operation's; a turn ("chat", "generate", "append") asked under
        another model's scope (a front's request naming it) is refused, never run on another model."""
        name, asked = self.model_of(entry), CURRENT.get()
        if asked is not None and asked != name and op in ("chat", "generate", "append"):
            raise InvalidParamsError(f"session {entry.id} belongs to model {name!r}, not {asked!r}: a session "
                                     "continues only on its own model", session_id=entry.id, model=name,
                                     requested=asked, param="model")
        with self.scoped(name):
            yield

    # -- loading ---------------------------------------------------------------

    async def ensure(self, name: str) -> LoadedModel:
        """Model `name`, loaded first if it is not (UnknownModelError if it is not served)."""
        spec = self.registry.spec(name)
        while True:
            if name in self._unloads or name in self._draining:
                self._blocked[name] += 1
                try:
                    await asyncio.sleep(WAIT_S)
                finally:
                    self._blocked[name] -= 1
            elif name in self.models:
                return self.models.get(name)
            else:
                load = self._loads.get(name)
                if load is None:
                    load = self._loads[name] = asyncio.get_running_loop().create_task(self._load(spec))
                    load.add_done_callback(lambda _t: self._loads.pop(name, None))
                await asyncio.shield(load)  # a caller that leaves does not stop the load others wait for
                if name in self.models:  # loaded for those waiting: they run, even if it drains already
                    return self.models.get(name)

    async def _load(self, spec: ModelSpec) -> None:
        if self._start is None:
            raise InvalidParamsError(f"model {spec.name!r} is not loaded and this manager cannot load models")
        try:
            need = await self.weights_needed(spec)  # a hub id downloaded first: not while holding `_admit`
        except ModelsBudgetError:
            raise
        except Exception as exc:  # a bad path, a download that failed
            raise _load_failed(spec, exc) from exc
        if self._admit is None:
            self._admit = asyncio.Lock()
        async with self._admit:
            await self._room_for(spec, need)
            self._loading_since[spec.name] = time.time()
            reader = self.read_ahead.begin(spec.name, self.settings)  # the waiting sessions' blocks, beside it
            started = time.perf_counter()
            try:
                engine, thread = await to_thread.run_sync(
                    lambda: self._start(spec, ram_tier=reader.tier if reader is not None else None))
            except Exception as exc:  # weights or a tokenizer that do not load
                await self._drop_reader(spec.name)  # no wake takes what it read
                raise _load_failed(spec, exc) from exc
            finally:
                self._loading_since.pop(spec.name, None)
            model = self.models.add(engine, thread, spec.name)
            if reader is not None:  # what it read for snapshots of another bundle cannot wake on this engine
                reader.keep_bundle(engine.bundle.hash)
            self._last_use[spec.name] = time.monotonic()
            await to_thread.run_sync(self._loaded, model)
            self._bind_noted(model)
            self.fit_rooms()
            self._load_ms[spec.name] = round((time.perf_counter() - started) * 1000, 1)
        # as the start's models warm, once the operations that waited for the load have run (a reloaded model's
        # first wake waited for a warm-up job that began just before it)
        warming = asyncio.get_running_loop().create_task(warm_model(model, lambda: self._in_use(spec.name)))
        self._warming[spec.name] = warming  # held: the loop keeps only weak references to tasks
        warming.add_done_callback(lambda done, name=spec.name: self._warming.pop(name, None)
                                  if self._warming.get(name) is done else None)
        log.info("model loaded", extra={"model": spec.name, "bundle": model.bundle.hash,
                                        "ms": self._load_ms[spec.name]})

    async def _drop_reader(self, name: str) -> None:
        """The reader of model `name`'s load stopped (on a worker thread), what it holds dropped."""
        reader = self.read_ahead.end(name)
        if reader is not None:
            await to_thread.run_sync(reader.stop)

    def _loaded(self, model: LoadedModel) -> None:
        """Note a model just loaded: its weights' bytes, and its bundle's name in the bundles file."""
        self._weights[model.name] = model.engine.weights_bytes
        if self._bundles.get(model.bundle.hash) != model.name:
            self._bundles[model.bundle.hash] = model.name
            write_durable(self._bundles_path, json.dumps(self._bundles, indent=1, sort_keys=True).encode())

    def _unloadable(self, name: str) -> bool:
        """Never unloaded: pinned models, and the remote tier's (it holds that engine)."""
        remote = self.remote is not None and self.remote.engine is self.models.get(name).engine
        return not (self.registry.spec(name).pinned or remote)

    def _in_use(self, name: str) -> bool:
        """Whether an operation runs on the model or is about to (waiting for its load, not held back by its
        unload or draining), or one of its sessions is claimed."""
        return self._uses[name] > 0 or self._waits[name] > self._blocked[name] or \
            self._of_model(self.entries.models.busy, name) > 0

    # -- unloading -------------------------------------------------------------

    async def unload(self, name: str, why: str = "asked") -> dict[str, Any]:
        """Sleep every hot session of model `name`, then stop it. InvalidParamsError for a pinned model; a
        failed sleep leaves the model loaded and raises. An unload asked while one runs waits for that one
        and answers as it does (the lifecycle, a load making room and `model.unload` may ask at once)."""
        self.registry.spec(name)
        unloading = self._unloads.get(name)
        if unloading is None:
            if name not in self.models:
                return {"model": name, "unloaded": False, "slept": 0}
            if not self._unloadable(name):
                raise InvalidParamsError(f"model {name!r} is pinned: it is never unloaded", model=name)
            unloading = self._unloads[name] = asyncio.get_running_loop().create_task(self._unload(name, why))
        return await asyncio.shield(unloading)  # a caller that leaves does not stop the unload others wait for

    async def _unload(self, name: str, why: str) -> dict[str, Any]:
        slept = 0
        left: dict[str, int] = {}
        try:
            while self._uses[name] > 0:
                await asyncio.sleep(WAIT_S)
            while hot := [e for e in self.entries.hot.values() if self.model_of(e) == name]:
                for entry in hot:
                    with contextlib.suppress(BusyError):  # claimed now: looked at again once it is done
                        await self.sleep(entry.id)
                        slept += 1
                await asyncio.sleep(0 if slept else WAIT_S)
            await self.released()
            model = self.models.remove(name)
            self._shared.pop(name, None)
            await self._drop_reader(name)
            await self._end_warm_up(name)
            try:
                await to_thread.run_sync(stop_model, model)
            finally:
                del model  # the last reference: its weights go with the pass that follows
                left = await to_thread.run_sync(free_stopped)
            self.fit_rooms()  # its weights gone: the others' KV room grows by them
            self._build_ahead_later(name)
        finally:
            self._unloads.pop(name, None)
        log.info("model unloaded", extra={"model": name, "why": why, "slept": slept, **left})
        return {"model": name, "unloaded": True, "slept": slept}

    def _build_ahead_later(self, name: str) -> None:
        """Model `name`'s modules built again for its next load (model/weights.py `prepare`, where weights are read
        the mapped way and the model is a folder) once no model is in use. The first start built them once; a
        reload built its own beside the other models' decoding, which stalled every stream of theirs at the
        load's start (docs/benchmarks.md, "Several models"). Given up once the model is asked for again."""
        spec = self.registry.spec(name)
        folder = Path(spec.source).expanduser() if spec.source is not None else None
        if not self.settings.tuning.modules_ahead or folder is None or not folder.is_dir() \
                or not weights.builds_ahead(self.settings.tuning.weights_read) or name in self._building:
            return
        task = asyncio.get_running_loop().create_task(self._build_ahead(name, folder))
        self._building[name] = task  # held: the loop keeps only weak references to tasks
        task.add_done_callback(lambda done: self._building.pop(name, None) if self._building.get(name) is done
                               else None)

    async def _build_ahead(self, name: str, folder: Path) -> None:
        while True:
            if self.stopping:  # the daemon stops: nothing to build for
                return
            if name in self.models or name in self._loads or name in self._loading_since \
                    or self._waits[name] > 0:
                return  # asked for first: its load builds them
            if not any(self._in_use(n) for n in self.models.names()):
                break
            await asyncio.sleep(BUILD_POLL_S)
        started = time.perf_counter()
        # its tokenizer and template kept: the modules
        await to_thread.run_sync(weights.preload([folder], read=self.settings.tuning.weights_read).join)
        if weights.prepared(folder):
            log.info("model built ahead", extra={"model": name,
                                                 "ms": round((time.perf_counter() - started) * 1000, 1)})

    async def _end_warm_up(self, name: str) -> None:
        """Cancel model `name`'s warm-up (one still holding or queued holds the model: an idle job on a stopped
        thread was never answered, and the task kept the model, weights and all, for good) and let the task go:
        even cancelled, its traceback holds the model."""
        warming = self._warming.pop(name, None)
        if warming is not None:
            warming.cancel()
            await asyncio.wait([warming])
            del warming

    async def unload_idle(self) -> list[str]:
        """Unload the models unused past `model_ttl_s` (the lifecycle task's pass); their names."""
        ttl = self.settings.model_ttl_s
        if ttl is None:
            return []
        now, gone = time.monotonic(), []
        for name in self.models.names():
            if self._unloadable(name) and not self._in_use(name) and now - self._last_use.get(name, now) > ttl:
                await self.unload(name, why="idle")
                gone.append(name)
        return gone

    def _of_model(self, counts: Counter[str | None], name: str) -> int:
        """`name`'s count in one of `Entries.models`' counters (entries of no model name are the default's)."""
        return counts[name] + (counts[None] if name == self.registry.default.name else 0)

    def model_states(self) -> list[dict[str, Any]]:
        """Every model served, in order: its name, aliases, pinned, state (loaded, loading, unloaded), when
        loading its start (seconds since the epoch), when loaded its bundle hash, weights' bytes and its load
        (`load_ms`: the load on demand that serves it now, None for one loaded at the daemon's start;
        `load_phases_ms`: its engine's start by phase; `warmed`: its warm-up's jobs all ran), loading or loaded the
        reader of its load's sessions' blocks (`read_ahead`, None when none waited), and its sessions (hot,
        asleep)."""
        hot = Counter(self.model_of(e) for e in self.entries.hot.values())  # hot ones: as few as memory holds
        states = []
        for spec in self.registry:
            state = "loaded" if spec.name in self.models else "loading" if spec.name in self._loading_since \
                else "unloaded"
            row = {"name": spec.name, "aliases": list(self.registry.names(spec)[1:]), "patterns": list(spec.aliases),
                   "pinned": spec.pinned, "state": state, "source": spec.source,
                   "sessions": {"hot": hot[spec.name],
                                "asleep": self._of_model(self.entries.models.known, spec.name) - hot[spec.name]}}
            if state != "unloaded":  # the reader of its load's sessions' blocks (sessions/read_ahead.py)
                row["read_ahead"] = self.read_ahead.status(spec.name)
            if state == "loading":
                row["loading_since"] = self._loading_since[spec.name]
            if state == "loaded":
                row["bundle_hash"] = self.models.get(spec.name).bundle.hash
                row["weights_bytes"] = self._weights.get(spec.name)
                row["load_ms"] = self._load_ms.get(spec.name)
                row["load_phases_ms"] = self.models.get(spec.name).started_ms
                row["warmed"] = self.models.get(spec.name).warmed.is_set()
            states.append(row)
        return states


def _load_failed(spec: ModelSpec, exc: Exception) -> ModelLoadError:
    log.error("model load failed", extra={"model": spec.name, "source": spec.source, "error": repr(exc)})
    return ModelLoadError(f"model {spec.name!r} could not be loaded from {spec.source or 'the default'}: {exc}",
                          model=spec.name, source=spec.source)


def read_bundles(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        log.warning("model bundles file unreadable; sessions of other models than the default are attributed "
                    "to it until their model loads", extra={"path": str(path), "error": repr(exc)})
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
