"""The daemon's start-up (issue 23, point 6): what it imports, and what it leaves until after it answers."""

from __future__ import annotations

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
    env = {"PYTHONPATH": str(tmp_path / "site")}
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
