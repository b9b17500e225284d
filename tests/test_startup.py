"""The daemon's start-up (issue 23, point 6): what it imports, and what it leaves until after it answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.daemon import Daemon


@pytest.mark.parametrize("allowed", [False, True])
def test_the_daemon_never_imports_an_installed_pytorch(tmp_path, model_dir, allowed):
    # Was: where PyTorch is installed (the GPU machine, most ML workstations), transformers' tokenizer
    # imports loaded it and torchvision: 10+ s of a 21 s start there, for a daemon that runs MLX only.
    # A stand-in torch on the path records its import; KVWAKE_IMPORT_FRAMEWORKS=1 is the old behaviour.
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    marker = tmp_path / "torch-imported"
    fake.joinpath("__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n__version__ = '2.9.0'\n")
    # in front of the path the machine already uses (the GPU machine's packages come by PYTHONPATH)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    (tmp_path / "d").mkdir()
    if allowed:  # transformers imports it (the stand-in, being no PyTorch, then fails the start)
        d = Daemon(tmp_path / "d", model_dir, env={**env, "KVWAKE_IMPORT_FRAMEWORKS": "1"})
        with pytest.raises(RuntimeError, match="daemon exited"):
            d.start()
        assert marker.exists()
        return
    d = Daemon(tmp_path / "d", model_dir, env=env).start()
    try:
        c = d.client()
        c.call("session.create", session_id="s")
        c.call("session.chat", session_id="s", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        c.close()
    finally:
        assert d.stop() == 0
    assert not marker.exists()
    assert d.log_problems() == []


def test_frameworks_are_not_hidden_from_a_process_that_imported_transformers_already(tmp_path):
    # transformers caches what is available at its import: hiding torch afterwards made its next model
    # load fail (torchvision.io, LlamaConfig) in a process that ran `serve` after loading a model.
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    fake.joinpath("__init__.py").write_text("__version__ = '2.9.0'\n")
    probe = ("import sys, transformers; from kvwake.client.cli import hide_unused_frameworks; "
             "hide_unused_frameworks(); print(sys.modules.get('torch', 'absent'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    env.pop("KVWAKE_IMPORT_FRAMEWORKS", None)
    after = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert after.stdout.strip() != "None", after.stdout  # not hidden
    before = subprocess.run([sys.executable, "-c", probe.replace("import sys, transformers;", "import sys;")],
                            env=env, capture_output=True, text=True, check=True)
    assert before.stdout.strip() == "None"  # a fresh process (the daemon's): hidden
