"""A pytest plugin: test files run with tuning knobs set from the environment, in-process engines and daemons alike.

    KVWAKE_PAGED_KV=true python -m pytest -p testkit.tuned tests/test_engine.py tests/test_daemon.py

Daemons read the KVWAKE_<NAME> variables themselves (daemon/config.py); an engine a test makes in process
takes `Tuning()` unless the test passes its own, so this plugin makes the knobs set in the environment that
default. A test that passes its own tuning keeps it. For checking a knob before it becomes the default
(docs/decisions.md says which tests fail with it on, and why).
"""

from __future__ import annotations

from kvwake.daemon.config import Tuning, load_tuning, tuning_from_environment
from kvwake.daemon.model.engine import Engine

TUNED = load_tuning(tuning_from_environment())  # raises ValueError naming a bad variable
defaults = Engine.__init__.__kwdefaults__ or {}
if not isinstance(defaults.get("tuning"), Tuning):
    raise TypeError("Engine no longer takes a keyword `tuning` with a Tuning default: testkit.tuned needs updating")
Engine.__init__.__kwdefaults__ = {**defaults, "tuning": TUNED}


def pytest_report_header() -> str:
    changed = {name: value for name, value in vars(TUNED).items() if getattr(Tuning(), name) != value}
    return f"testkit.tuned: {changed or 'no knob changed'}"
