"""The models a daemon may serve, by name (docs/decisions.md, "Several models (issue 53)").

From `Settings`: `model` (the first `--model`: the default model), `more_models` (each further `--model`:
`PATH`, a hub id, or `NAME=PATH`), `models_dir` (each folder in it holding a `config.json`, by its folder
name) and `models` (the config file's `[models]` table: `name = "path"` or `name = {path = "...",
aliases = ["claude-haiku-*"], pinned = true}`). The first one is the default; with none given, the
default model (`model = None`: SmolLM2, converted once).

A name a request gives resolves by: a model's own name, one of its aliases (shell patterns), then the
`[aliases]` table; with one model and no alias anywhere, any name is that model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvwake.daemon.config import ModelSpec, parse_models_table
from kvwake.daemon.model.convert import DEFAULT_MODEL_NAME
from kvwake.errors import InvalidParamsError, NotFoundError

__all__ = ["ModelSpec", "Registry", "UnknownModelError", "parse_models_table"]


class UnknownModelError(NotFoundError):
    """A request named a model this daemon does not serve."""


def _name_of(source: str) -> str:
    """The name a model is served by when none is given: a folder's name, or the hub id (as the engine
    names it: model/engine.py resolve_model)."""
    path = Path(source).expanduser()
    return path.name if path.is_dir() else source


def _flag(value: str) -> ModelSpec:
    name, sep, source = value.partition("=")
    if sep and name and source and not Path(value).expanduser().is_dir():  # a folder may have "=" in its name
        return ModelSpec(name, source)
    return ModelSpec(_name_of(value), value)


def _in_folder(folder: Path) -> list[ModelSpec]:
    if not folder.is_dir():
        raise ValueError(f"--models-dir {folder} is not a folder")
    return [ModelSpec(p.name, str(p)) for p in sorted(folder.iterdir()) if (p / "config.json").is_file()]


class Registry:
    """The models served, the default first, and how a requested name resolves to one of them."""

    def __init__(self, specs: list[ModelSpec], aliases: Mapping[str, str] | None = None) -> None:
        self.specs: dict[str, ModelSpec] = {}
        for spec in specs or [ModelSpec(DEFAULT_MODEL_NAME, None)]:
            if spec.name in self.specs:
                raise ValueError(f"model {spec.name!r} is given twice")
            self.specs[spec.name] = spec
        self.aliases = dict(aliases or {})
        for alias, target in self.aliases.items():
            if target not in self.specs:
                raise ValueError(f"[aliases] {alias!r} names model {target!r}, which is not served "
                                 f"(served: {', '.join(self.specs)})")

    @classmethod
    def from_settings(cls, settings: Any) -> Registry:
        """The registry `settings` describe (the module docstring says from what); ValueError if bad."""
        specs = [] if settings.model is None and (settings.more_models or settings.models or settings.models_dir) \
            else [_flag(str(settings.model)) if settings.model is not None else ModelSpec(DEFAULT_MODEL_NAME, None)]
        specs += [_flag(v) for v in settings.more_models]
        if settings.models_dir is not None:
            specs += _in_folder(Path(settings.models_dir).expanduser())
        table = parse_models_table(settings.models)  # a name given twice: the table's entry (aliases, pinned) wins
        specs = [table.pop(s.name) if s.name in table else s for s in specs] + list(table.values())
        return cls(specs, settings.aliases)

    @property
    def default(self) -> ModelSpec:
        return next(iter(self.specs.values()))

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(list(self.specs.values()))

    def __len__(self) -> int:
        return len(self.specs)

    def spec(self, name: str) -> ModelSpec:
        """The model called `name` exactly (a model's own name); UnknownModelError names those served."""
        spec = self.specs.get(name)
        if spec is None:
            raise self._unknown(name)
        return spec

    def resolve(self, requested: Any) -> ModelSpec:
        """The model a request's `model` names (None: the default); UnknownModelError if none does."""
        if requested is None:
            return self.default
        if not isinstance(requested, str):
            raise InvalidParamsError("model must be a string", param="model")
        for spec in self.specs.values():
            if spec.answers(requested):
                return spec
        if requested in self.aliases:
            return self.specs[self.aliases[requested]]
        if len(self.specs) == 1 and not self.aliases and not self.default.aliases:
            return self.default  # one model, no names set: every name is it
        raise self._unknown(requested)

    def names(self, spec: ModelSpec) -> list[str]:
        """The names `spec` is listed by (/v1/models): its own, then the plain (not pattern) aliases."""
        plain = [a for a in spec.aliases if not any(c in a for c in "*?[")]
        return [spec.name, *plain, *(alias for alias, target in self.aliases.items() if target == spec.name)]

    def _unknown(self, requested: str) -> UnknownModelError:
        return UnknownModelError(f"model {requested!r} is not served: this daemon serves {', '.join(self.specs)}",
                                 model=requested, served=list(self.specs))
