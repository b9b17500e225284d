"""The current Codex CLI and Claude Code releases (from npm) against a real daemon: each answers, continues
its thread, and continues it again after the daemon restarts (issue 50, point 8: agents run unchanged).

Both run as bench/codex_cli.py and bench/claude_code.py run them (their `run_turns`), on a scripted tiny
model (1 byte = 1 token, a 128k context). Codex runs with its default config (only the kvwake provider
added, so it sends OpenAI's web_search tool) against the daemon's default settings. Claude Code runs with
its built-in tools off (`--tools ""`, no other setting): its default tools make its request three times as
long, which on this tokenizer is a CPU prefill far beyond a test's time (bench/claude_code.py
`--tools default` runs it). Marked slow: each first turn prefills ~30-40k tokens on the CPU. npm must
reach its registry the first time (the packages are kept under ~/.cache/kvwake-bench).
"""

from __future__ import annotations

import pytest

from bench import claude_code, codex_cli
from bench.lib import npm_binary


@pytest.mark.slow
def test_codex_cli_with_its_default_config_answers_and_continues_across_a_restart(tmp_path):
    codex = npm_binary("@openai/codex", "codex", codex_cli.VERSION)
    rows, problems = codex_cli.run_turns(codex, tmp_path, "exec", "omit")
    for row in rows:
        assert row["errors"] == [], row
        kinds = [item["type"] for item in row["items"]]
        assert "command_execution" in kinds, row  # Codex ran the tool the model called
        said = [item["text"] for item in row["items"] if item["type"] == "agent_message"]
        assert said == ["".join(codex_cli.ANSWER)], row
    first, later = rows[0]["turn_usage"], [row["turn_usage"] for row in rows[1:]]
    # Each later turn, the one after the restart too, computes its new items only: the thread is cached.
    assert all(u["computed_input_tokens"] < 1000 < first["computed_input_tokens"] for u in later), rows
    assert problems == []


@pytest.mark.slow
def test_claude_code_answers_and_continues_across_a_restart(tmp_path):
    claude = npm_binary("@anthropic-ai/claude-code", "claude", claude_code.VERSION)
    rows, problems = claude_code.run_turns(claude, tmp_path, "")
    for row in rows:
        assert row["is_error"] is False and row["result"] == "".join(claude_code.REPLY), row
    first = rows[0]
    for row in rows[1:]:  # the later turns, the one after the restart too, read the conversation from the cache
        assert row["input_tokens"] < 1000 < first["input_tokens"], rows
        assert row["cache_read_input_tokens"] >= first["input_tokens"], rows
    assert problems == []
