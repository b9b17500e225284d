"""The model provider: every loaded model by name, and what serves it.

Everything that needs "the model" (the session manager, status, the warm-up,
the fronts through the manager) asks the provider, as mlx-lm's server asks its
`ModelProvider`: for a model by name it answers with a `LoadedModel`, the
engine that computes on it and the engine thread its MLX work runs on.
Nothing else holds a model.

Today the daemon loads one model at start (`serve.py`) and every name resolves
to it; sessions are tied to it by its bundle hash. Several models by name,
loaded on demand and unloaded without loss, build on this (docs/decisions.md,
"One scheduler, one model provider").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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

    @property
    def name(self) -> str:
        return self.engine.model_name

    @property
    def bundle(self) -> Bundle:
        return self.engine.bundle

    @property
    def tokenizer(self):  # noqa: ANN201 - mlx-lm's TokenizerWrapper
        return self.engine.tokenizer


class ModelProvider:
    """The loaded models by name. `get(None)` is the default model: the first one added."""

    def __init__(self) -> None:
        self._models: dict[str, LoadedModel] = {}

    @classmethod
    def of(cls, engine: Engine, thread: EngineThread) -> ModelProvider:
        """A provider serving one model (`add`)."""
        provider = cls()
        provider.add(engine, thread)
        return provider

    def add(self, engine: Engine, thread: EngineThread) -> LoadedModel:
        """Serve `engine`'s model under its name (its folder name or hub id), its MLX work on `thread`: the
        thread steps the engine's decoder between jobs and takes its prefill planner's jobs from now on."""
        model = LoadedModel(engine, thread)
        if model.name in self._models:
            raise ValueError(f"model {model.name!r} is loaded already")
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

    def names(self) -> list[str]:
        """The loaded models' names, the default first."""
        return list(self._models)

    def __iter__(self):  # noqa: ANN204
        return iter(list(self._models.values()))
