"""One memory budget for every loaded model: their weights and their hot sessions' KV together.

The budget is what MLX's memory limit leaves beside a prefill's scratch (model/memory.py `kv_room` with no
weights), or `models_budget_bytes` where that is less. Each engine's KV room (`Engine.kv_room_bytes`, and
from it its hot budget and its longest session) is the budget less every loaded model's weights, set
again at each load and unload (sessions/models.py); the hot KV held against it is every model's
(sessions/room.py `hot_bytes`). So two models never plan more KV than the device holds, and a load makes
room for its weights first (idle sessions sleep, then models are unloaded).

A model not loaded yet is counted by the bytes of its weights files (`*.safetensors`, what mlx-lm loads)
in its folder, a hub id's once downloaded; a model whose size cannot be told is refused, not guessed
(docs/decisions.md, "Several models (issue 53)").
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvwake.daemon.config import Settings
from kvwake.daemon.model import memory
from kvwake.daemon.model.registry import Registry
from kvwake.errors import KvwakeError

__all__ = ["ModelsBudgetError", "budget_bytes", "check_fits_budget", "check_pinned", "gb", "weights_on_disk"]


class ModelsBudgetError(KvwakeError):
    """Models' weights (and KV) that cannot fit the memory budget; the message carries the figures."""


def gb(nbytes: int) -> str:
    """Bytes as an error message shows them: GB, MB or kB with three digits or more, else bytes."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}" if nbytes < 100 * size else f"{nbytes / size:.0f} {unit}"
    return f"{nbytes} B"


def budget_bytes(limits: memory.Limits | None, configured: int | None) -> int | None:
    """Bytes the loaded models' weights and their hot KV may take together: what `limits` leave beside a
    prefill's scratch, or `configured` (models_budget_bytes) where less; None with neither."""
    known = [b for b in (memory.kv_room(limits, 0) if limits is not None else None, configured) if b is not None]
    return min(known) if known else None


def weights_on_disk(source: str | None, data_dir: Path) -> int:
    """The bytes of a model's weights files, a hub id downloaded first (mlx-lm's cache) and the default model
    converted first (blocking: from a worker thread). ModelsBudgetError if its folder holds none."""
    from kvwake.daemon.model.engine import resolve_model

    folder, _ = resolve_model(source, Path(data_dir))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelsBudgetError(f"model {source or 'default'} has no *.safetensors in {folder}: the size of its "
                                "weights is unknown, so it cannot be planned within the memory budget",
                                source=source, folder=str(folder))
    return sum(p.stat().st_size for p in files)


def check_fits_budget(weights: Iterable[tuple[str, int]], budget: int | None, what: str) -> None:
    """ModelsBudgetError naming each model's weights, their sum and `budget` when the sum passes it;
    `what`: the models in question ("the pinned models")."""
    weights = list(weights)
    total = sum(n for _, n in weights)
    if budget is not None and total > budget:
        each = " + ".join(f"{name} {gb(n)}" for name, n in weights) + (f" = {gb(total)}" if len(weights) > 1 else "")
        raise ModelsBudgetError(f"{what} do not fit the memory budget: {each} of weights > "
                                f"{gb(budget)} (models_budget_bytes, or what MLX's memory limit leaves beside "
                                "a prefill's scratch)", weights=dict(weights), budget_bytes=budget)


def check_pinned(registry: Registry, settings: Settings, default_weights: int, limits: memory.Limits | None) -> None:
    """At start, the default model loaded (`default_weights`): the pinned models beside it must fit the
    budget, or the start fails with ModelsBudgetError (they are never unloaded to make room)."""
    pinned = [(s.name, weights_on_disk(s.source, settings.data_dir)) for s in registry
              if s.pinned and s is not registry.default]
    if pinned:
        check_fits_budget([(registry.default.name, default_weights), *pinned],
                          budget_bytes(limits, settings.models_budget_bytes), "the default and pinned models")
