"""Test daemons forked from the warm parent (testkit/warmfork.py): only where a fresh start would give the
same process, and answering as a Popen does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from testkit.daemon import Daemon
from testkit.warmfork import Children, ForkedProcess, cuda_installed, can_fork, warm_parent

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.environ.get("TESTKIT_FRESH_DAEMONS") == "1",
                                reason="daemons are forked on Linux only, unless TESTKIT_FRESH_DAEMONS=1")
# where MLX's CUDA backend is installed every daemon starts fresh (a GPU context does not survive a fork)
forks = pytest.mark.skipif(cuda_installed(), reason="MLX runs on CUDA here: no daemon is forked")


@forks
def test_the_warm_parent_has_the_runs_environment_not_that_of_the_test_that_starts_it(monkeypatch, tmp_path):
    # Was: it took the environment of the test whose daemon started it (first in a module run alone, as
    # here), and every later daemon, whose test had not changed it, started fresh.
    monkeypatch.setenv("TESTKIT_ONLY_THIS_TEST", "1")
    assert "TESTKIT_ONLY_THIS_TEST" not in warm_parent().env
    monkeypatch.delenv("TESTKIT_ONLY_THIS_TEST")
    assert can_fork(["--model", "m"], {**os.environ, "KVWAKE_CONFIG": str(tmp_path / "none.toml")})


@forks
def test_a_daemon_is_forked_only_where_its_imports_would_see_the_same(tmp_path):
    env = {**os.environ, "KVWAKE_CONFIG": str(tmp_path / "none.toml")}
    assert can_fork(["--model", "m"], env)  # settings are read at the start, not at import
    assert can_fork(["--model", "m"], {**env, "PYTEST_CURRENT_TEST": "another test"})
    assert can_fork(["--remote", "s3://b/p"], {**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:1"})  # the settings'
    for key, value in warm_parent().set_by_imports.items():  # what the imports set themselves
        assert can_fork(["--model", "m"], {**env, key: value})
        assert not can_fork(["--model", "m"], {**env, key: value + "0"})
    assert not can_fork(["--model", "m"], {**env, "PYTHONPATH": str(tmp_path)})
    assert not can_fork(["--model", "m"], {**env, "KVWAKE_IMPORT_FRAMEWORKS": "1"})
    assert not can_fork(["--model", "m", "--tune", "import_frameworks=1"], env)
    (tmp_path / "none.toml").write_text("[tuning]\nimport_frameworks = true\n")
    assert not can_fork(["--model", "m"], env)


@forks
def test_a_forked_daemon_answers_as_a_popen_and_exits_with_its_own_code(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    assert isinstance(d.proc, ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        d.proc.wait(0.05)
    assert d.proc.poll() is None
    d.proc.send_signal(signal.SIGKILL)
    assert d.proc.wait(30) == -signal.SIGKILL and d.proc.poll() == -signal.SIGKILL
    d.proc.kill()  # its exit is known: no signal goes to a pid that may be another's by now
    again = Daemon(tmp_path, model_dir).start()  # on the same data dir, as a restart after kill -9
    assert again.stop() == 0 and "Traceback" not in again.log.read_text()


def test_a_reused_pid_is_another_child_whose_exit_is_its_own():
    # Was: exits were kept by pid, so a daemon given the pid of one that had exited looked exited at once.
    children = Children()
    first = children.started(4242)
    children.exited(4242, -9)
    second = children.started(4242)  # reaped, its pid given to a later fork
    assert children.exits == {first: -9} and second != first
    children.exited(4242, 0)
    assert children.exits == {first: -9, second: 0}
