"""Room for a model to load, within one memory budget for every loaded model's weights and hot KV.

Part of the session manager (`ModelKeeping` in sessions/models.py takes these methods; the budget itself is
model/budget.py). Before a load, while the load would pass `max_loaded`, or the loaded models' weights,
the hot sessions' KV and the new model's weights would pass the budget: idle hot sessions sleep first,
least recently used first, where that alone makes room (a sleep costs less than an unload); else models
are unloaded, least recently used first. After each load and unload, every loaded engine's KV room is set
again to what the budget leaves beside all their weights.
"""

from __future__ import annotations

import asyncio

from anyio import to_thread

from kvwake.daemon.model import budget as membudget
from kvwake.daemon.model.registry import ModelSpec
from kvwake.errors import BusyError

__all__ = ["ModelRoom"]

WAIT_S = 0.01  # how often a load waiting for a model in use looks again


class ModelRoom:
    """The session manager's room-making for loads (see the module docstring); `SessionManager` holds the
    state (`_weights`, `_limits`, `_draining`, `_last_use`)."""

    def budget(self) -> int | None:
        """Bytes every loaded model's weights and hot KV may take together (model/budget.py); None: no limit."""
        return membudget.budget_bytes(self._limits, self.settings.models_budget_bytes)

    def weights_loaded(self) -> int:
        return sum(self._weights.get(n, 0) for n in self.models.names())

    def fit_rooms(self) -> None:
        """Each loaded engine's KV room: the budget less every loaded model's weights (at each load and unload)."""
        budget = self.budget()
        room = None if budget is None else max(0, budget - self.weights_loaded())
        for model in self.models:
            model.engine.set_kv_room(room)

    async def weights_needed(self, spec: ModelSpec) -> int:
        """The bytes `spec`'s weights will take: as measured at its last load, else its weights files' (a hub id
        downloaded first, on a worker thread). ModelsBudgetError if unknown, or more than the whole budget."""
        need = self._weights.get(spec.name)
        if need is None:
            need = await to_thread.run_sync(membudget.weights_on_disk, spec.source, self.settings.data_dir)
        membudget.check_fits_budget([(spec.name, need)], self.budget(), f"model {spec.name!r}'s weights")
        return need

    def _over(self, need: int) -> str | None:
        """Why loading a model of `need` bytes of weights beside the loaded ones does not fit: "max_loaded",
        "budget" (weights and hot KV), or None when it fits."""
        limit, budget = self.settings.max_loaded, self.budget()
        if limit is not None and len(self.models) + 1 > limit:
            return "max_loaded"
        if budget is not None and self.weights_loaded() + need + self.hot_bytes() > budget:
            return "budget"
        return None

    async def _room_for(self, spec: ModelSpec, need: int) -> None:
        """Make room for `spec` (`need` bytes of weights): idle sessions sleep where that alone makes it fit;
        else models are unloaded, least recently used first. While every one that could go is in use, the
        least recently used drains: its operations in flight end, new ones wait for its unload (and then load
        it again), so a model in steady use takes turns with the load instead of starving it. BusyError at
        once if only pinned models stand in the way."""
        try:
            while why := self._over(need):
                budget = self.budget()
                if why == "budget" and budget is not None and self.weights_loaded() + need <= budget and \
                        await self._sleep_lru(lambda e: self._over(need) is not None, "room_sleeps"):
                    continue
                candidates = [n for n in self.models.names() if self._unloadable(n)]
                if not candidates:
                    raise BusyError(self._stuck(spec, need, why), model=spec.name, why=why,
                                    max_loaded=self.settings.max_loaded, budget_bytes=budget)
                idle = [n for n in candidates if not self._in_use(n)]
                if idle:
                    await self.unload(min(idle, key=lambda n: self._last_use.get(n, 0.0)), why="room")
                    self._draining.clear()  # gone, if it drained: the next in use drains, its own loads run
                else:
                    if not self._draining:  # chosen once: the one that waits longest unused goes
                        self._draining.add(min(candidates, key=lambda n: self._last_use.get(n, 0.0)))
                    await asyncio.sleep(WAIT_S)
        finally:
            self._draining.clear()  # one room-making at a time (`_admit`): what drains is this one's

    def _stuck(self, spec: ModelSpec, need: int, why: str) -> str:
        loaded = ", ".join(self.models.names())
        if why == "max_loaded":
            return f"model {spec.name!r} cannot load: the loaded models ({loaded}) are pinned and fill max_loaded"
        return (f"model {spec.name!r} cannot load: its weights ({membudget.gb(need)}) beside the pinned models' "
                f"({loaded}: {membudget.gb(self.weights_loaded())}) and the hot KV that stays "
                f"({membudget.gb(self.hot_bytes())}) pass the memory budget ({membudget.gb(self.budget() or 0)})")
