"""The README holds exactly two set-up commands, and CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_has_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)\n```", setup, re.S)
    assert len(blocks) == 2 and all("\n" not in b for b in blocks)
    main_job, tests = blocks
    assert "pytest" in tests and "pytest" not in main_job
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == tests


def test_protocol_doc_names_every_method_and_error_code():
    from kvwake.daemon.fronts.methods import METHODS
    from kvwake.errors import CODES

    doc = (ROOT / "docs" / "protocol.md").read_text()
    documented = set(re.findall(r"^### `([a-z.]+)\(", doc, re.M))
    assert documented == set(METHODS), f"undocumented: {set(METHODS) - documented}, stale: {documented - set(METHODS)}"
    assert all(f"`{code}`" in doc for code in CODES)
