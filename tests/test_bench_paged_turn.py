"""bench/paged_turn.py runs at a small shape to its report, and its two chunk paths agree."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx

from testkit.daemon import REPO


def test_a_lone_turns_attention_over_pages_and_over_a_buffer_is_timed_and_agrees(tmp_path):
    result = subprocess.run([sys.executable, "bench/paged_turn.py", "--layers", "2", "--tokens", "600", "--queries", "20",
                             "--block", "16", "--rounds", "2", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "paged_turn.json").read_text())
    row = report["rows"][0]
    assert (row["tokens"], row["layers"], row["queries"]) == (600, 2, 20) and row["bytes"] == 2 * 2 * 8 * 128 * 2 * 600
    assert all(row[f"{name}_ms"] > 0 and len(report["samples_ms"][name]) == 2
               for name in ("chunk_paged", "chunk_plain", "copy", "step_paged", "step_plain"))
    # the pages copied to the key bucket and the whole buffer, both masked: the same attention (bit for bit on the
    # CPU, whose fused kernel adds the masked keys' exact zeros; on a GPU within bf16's rounding)
    assert row["chunk_max_diff"] == 0.0 if mx.default_device() == mx.cpu else row["chunk_max_diff"] < 0.05
