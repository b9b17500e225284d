"""The model provider: every loaded model by name, and what serves it.

Everything that needs "the model" (the session manager, status, the warm-up,
the fronts through the manager) asks the provider, as mlx-lm's server asks its
`ModelProvider`: for a model by name it answers with a `LoadedModel`, the
engine that computes on it and the engine thread its MLX work runs on.
Nothing else holds a model.

The provider holds what is loaded now; which models may be served and what a
requested name means is the registry's (model/registry.py), and when a model
loads or unloads is the session manager's (sessions/models.py): an unload
sleeps the model's sessions first (docs/decisions.md, "Several models (issue 53)").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvwake.errors import NotFoundError

if TYPE_CHECKING:
    from kvwake.daemon.kv.bundle import Bundle
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.thread import EngineThread

__all__ = ["LoadedModel", "ModelProvider"]


@dataclass(frozen=True)
class LoadedModel:
    """One model in memory: `engine` computes on it (model/engine.py), `thread` runs its MLX work."""

    engine: Engine
    thread: EngineThread
    served_as: str | None = None  # the registry's name for it (model/registry.py); None: the engine's own
    # set once its warm-up's jobs all ran (model/loader.py warm_model; at once where it has none): until then idle
    # moments run them, and what MLX holds moves with them
    warmed: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.served_as if self.served_as is not None else self.engine.model_name

    @property
    def bundle(self) -> Bundle:
        return self.engine.bundle

    @property
    def tokenizer(self):  # noqa: ANN201 - mlx-lm's TokenizerWrapper
        return self.engine.tokenizer

    @property
    def started_ms(self) -> dict[str, float]:
        """Where its engine's start (its load) went: ms by phase, in order."""
        return dict(self.engine.started.ms)

    @property
    def weight_pieces(self) -> list[dict[str, Any]]:
        """Each piece of its weights' read: `at_ms` from its engine's start, `ms`, `bytes` (model/weights.py)."""
        return list(self.engine.weight_pieces)


class ModelProvider:
    """The loaded models by name. `get(None)` is the first one loaded of those still loaded."""

    def __init__(self) -> None:
        self._models: dict[str, LoadedModel] = {}

    @classmethod
    def of(cls, engine: Engine, thread: EngineThread) -> ModelProvider:
        """A provider serving one model (`add`)."""
        provider = cls()
        provider.add(engine, thread)
        return provider

    def add(self, engine: Engine, thread: EngineThread, name: str | None = None) -> LoadedModel:
        """Serve `engine`'s model under `name` (None: its own, its folder name or hub id), its MLX work on
        `thread`: the thread steps the engine's decoder between jobs and takes its prefill planner's jobs
        from now on."""
        model = LoadedModel(engine, thread, name)
        if model.name in self._models:
            raise ValueError(f"model {model.name!r} is loaded already")
        if not thread.attached(engine.decoder):  # model/loader.py attaches a model's before its first job
            thread.attach(engine.decoder, engine.planner)
        self._models[model.name] = model
        return model

    def get(self, name: str | None = None) -> LoadedModel:
        """The model called `name` (None: the default one); NotFoundError names the ones loaded."""
        if not self._models:
            raise NotFoundError("no model is loaded")
        if name is None:
            return next(iter(self._models.values()))
        model = self._models.get(name)
        if model is None:
            raise NotFoundError(f"model {name!r} is not loaded; loaded: {', '.join(self._models)}", model=name)
        return model

    def remove(self, name: str) -> LoadedModel:
        """Stop serving `name` (its caller stops its thread and closes its engine: model/loader.py)."""
        model = self.get(name)
        del self._models[name]
        return model

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __len__(self) -> int:
        return len(self._models)

    def names(self) -> list[str]:
        """The loaded models' names, the default first."""
        return list(self._models)

    def __iter__(self):  # noqa: ANN204
        return iter(list(self._models.values()))
