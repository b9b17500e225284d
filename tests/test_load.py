"""A short load run (testkit/load.py): 32 clients over RPC and HTTP with disconnects and a kill -9 mid-run."""

from __future__ import annotations

import json

import pytest

from testkit import load
from testkit.load import failed_checks, run_load


@pytest.mark.slow
def test_load_with_faults_loses_no_acknowledged_sleep_and_never_fails_internally(tmp_path, monkeypatch):
    made: list[load.HttpAgent] = []

    class Kept(load.HttpAgent):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(load, "HttpAgent", Kept)
    result = run_load(tmp_path, clients=32, seconds=8)
    # The run closes its clients: one left to the collector warned of its sockets in a later module's test
    assert len(made) == 16 and all(a.api.is_closed() for a in made)
    assert failed_checks(result) == [], result
    assert result["faults"]["kill -9"] == 1 and result["faults"]["disconnects"] > 0
    assert result["outcomes"]["down"] > 0  # the kill was felt: calls failed to connect meanwhile
    assert result["restart"]["down_before_kill"] == 0 and result["restart"]["down_after_restart"] <= 32
    assert result["internal"] == 0 and result["unexpected"] == {}
    assert result["acknowledged_sleeps"] > 0 and result["woke"] == result["acknowledged_sleeps"]
    assert result["fsck_ok"] and result["stop_exit"] == 0 and result["log_problems"] == []
    # each op ended well at least once (a dict's repr is cut in the report: its parts that say why, as text)
    assert {"rpc chat", "rpc tool", "rpc sleep", "http chat", "http tool"} <= set(result["latency"]), \
        json.dumps({k: result.get(k) for k in ("seconds", "calls", "outcomes", "failed_calls", "latency", "restart")})
