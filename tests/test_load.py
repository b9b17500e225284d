"""A short run of bench/load.py: 32 clients over RPC and HTTP with disconnects and a kill -9 mid-run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemon import REPO


@pytest.mark.slow
def test_load_with_faults_loses_no_acknowledged_sleep_and_never_fails_internally(tmp_path):
    run = subprocess.run([sys.executable, "bench/load.py", "--clients", "32", "--seconds", "20", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "load.json").read_text())
    assert run.returncode == 0, (run.stderr[-3000:], result)
    assert result["faults"]["kill -9"] == 1 and result["faults"]["disconnects"] > 0
    assert result["outcomes"]["down"] > 0  # the kill was felt: calls failed to connect meanwhile
    assert result["restart"]["down_before_kill"] == 0 and result["restart"]["down_after_restart"] <= 32
    assert result["internal"] == 0 and result["unexpected"] == {}
    assert result["acknowledged_sleeps"] > 0 and result["woke"] == result["acknowledged_sleeps"]
    assert result["fsck_ok"] and result["stop_exit"] == 0 and result["log_problems"] == []
    assert {"rpc chat", "rpc tool", "rpc sleep", "http chat", "http tool"} <= set(result["latency"])
