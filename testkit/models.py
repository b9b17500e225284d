"""Two tiny models of different families and a session manager on them, with no daemon (issue 53's tests)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from testkit.tinymodel import make_model_dir

__all__ = ["Served", "manager_on", "stop_manager", "two_tiny_models"]


class Served(dict):
    """Models as the daemon's warm-up reads its ModelProvider (serve._warm): name -> model, `names()` in order;
    for tests whose models are stand-ins."""

    def names(self) -> list[str]:
        return list(self)


def two_tiny_models(root: Path) -> tuple[Path, Path]:
    """A llama "main" and a gemma3 "small" model folder under `root`."""
    return (make_model_dir(root / "main", arch="llama", ascii_replies=True),
            make_model_dir(root / "small", arch="gemma3_text", seed=1, ascii_replies=True))


def manager_on(tmp_path: Path, models: tuple[Path, Path], **settings: Any):  # noqa: ANN201 - (manager, store)
    """A session manager (no daemon) on `main` loaded, loading the others served ("small", and "third": main's
    files again) on demand; `settings`: Settings fields. Returns (manager, store): stop_manager ends both."""
    from kvwake.daemon.config import Settings
    from kvwake.daemon.model.loader import start_model
    from kvwake.daemon.model.provider import ModelProvider
    from kvwake.daemon.model.registry import ModelSpec, Registry
    from kvwake.daemon.sessions.manager import SessionManager
    from kvwake.store import Store

    settings = Settings(socket=tmp_path / "s.sock", data_dir=tmp_path, **settings)
    store = Store(tmp_path / "store", block_tokens=16)
    registry = Registry([ModelSpec("main", str(models[0])), ModelSpec("small", str(models[1])),
                         ModelSpec("third", str(models[0]))])
    engine, thread = start_model(settings, store, registry.default, None)
    provider = ModelProvider()
    provider.add(engine, thread, "main")
    start = functools.partial(start_model, settings, store, limits=engine.limits)
    return SessionManager(provider, settings, registry, start), store


def stop_manager(manager: Any, store: Any) -> None:
    """Stop the manager's models as the daemon's stop does (their writes and restore points' work ended, then
    their threads), and the store: a reply point waiting for an engine thread's idle time otherwise held
    the test process's exit."""
    from kvwake.daemon.model.loader import stop_model

    manager.read_ahead.close()  # the loads' readers read the store
    for model in manager.models:
        stop_model(model)
    store.close()
