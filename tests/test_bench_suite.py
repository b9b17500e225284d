"""`kvwake bench NAME`: the registered workloads are listed, exist in bench/, and one runs to its report."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvwake.client.bench import WORKLOADS, bench_dir
from kvwake.client.cli import main


def test_list_names_every_registered_benchmark_and_each_script_is_in_bench():
    result = CliRunner().invoke(main, ["bench", "--list", "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert [w["name"] for w in listed] == [w.name for w in WORKLOADS]
    assert {"resume", "batching", "openai-turns", "responses-turns", "anthropic-turns", "persist", "matching", "load",
            "soak", "remote", "structured", "startup", "codec"} <= {w["name"] for w in listed}
    assert all((bench_dir() / w.script).is_file() for w in WORKLOADS)
    text = CliRunner().invoke(main, ["bench", "--list"]).stdout
    assert all(w.name in text for w in WORKLOADS)


def test_an_unknown_benchmark_is_refused_with_the_way_to_list_them():
    result = CliRunner().invoke(main, ["bench", "no-such-bench"])
    assert result.exit_code == 1 and "kvwake bench --list" in result.output


def test_the_startup_benchmark_runs_on_the_tiny_model_to_its_report(tmp_path):
    report = tmp_path / "startup.json"
    result = CliRunner().invoke(main, ["bench", "startup", "--model", "tiny", "--starts", "1", "--top", "5",
                                       "--json", str(report)])
    assert result.exit_code == 0, result.output
    out = json.loads(report.read_text())
    assert out["model"] == "tiny"
    assert out["in_process"]["engine_s"] > 0 and "cumulative" in out["in_process"]["profile"]
    [start] = out["daemon"]
    assert start["ready_s"] > 0 and start["first_request_s"] > 0 and start["second_request_s"] > 0
    assert isinstance(start["startup_ms"], dict) and start["startup_ms"]
