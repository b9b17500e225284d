"""The daemon's start-up: what it imports, and what it leaves until after it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.daemon import Daemon


@pytest.mark.parametrize("allowed", [False, True])
def test_the_daemon_never_imports_an_installed_pytorch(tmp_path, model_dir, allowed):
    # Was: where PyTorch is installed (most ML workstations), transformers' tokenizer imports loaded it
    # and torchvision: most of the daemon's start there, for a daemon that runs MLX only.
    # A stand-in torch on the path records its import; KVWAKE_IMPORT_FRAMEWORKS=1 is the old behaviour.
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    marker = tmp_path / "torch-imported"
    fake.joinpath("__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n__version__ = '2.9.0'\n")
    # and pandas, which sqlite-utils imported (with pyarrow: a slow import for nothing the daemon uses). Not
    # beside the allowed frameworks: sqlite-utils would fail on the stand-in wherever the store is imported
    # before transformers is, and the start would end before PyTorch's import it is there to show.
    pandas_marker = tmp_path / "pandas-imported"
    if not allowed:
        (tmp_path / "site" / "pandas").mkdir()
        (tmp_path / "site" / "pandas" / "__init__.py").write_text(f"open({str(pandas_marker)!r}, 'w').close()\n")
    # in front of the path the machine already uses (a machine's packages may come by PYTHONPATH)
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
    assert not pandas_marker.exists()
    assert d.log_problems() == []


def test_frameworks_are_not_hidden_from_a_process_that_imported_transformers_already(tmp_path):
    # transformers caches what is available at its import: hiding torch afterwards made its next model
    # load fail (torchvision.io, LlamaConfig) in a process that ran `serve` after loading a model.
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    fake.joinpath("__init__.py").write_text("__version__ = '2.9.0'\n")
    probe = ("import sys, transformers; from kvwake.daemon.imports import hide_unused_frameworks; "
             "hide_unused_frameworks(); print(sys.modules.get('torch', 'absent'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    env.pop("KVWAKE_IMPORT_FRAMEWORKS", None)
    after = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert after.stdout.strip() != "None", after.stdout  # not hidden
    before = subprocess.run([sys.executable, "-c", probe.replace("import sys, transformers;", "import sys;")],
                            env=env, capture_output=True, text=True, check=True)
    assert before.stdout.strip() == "None"  # a fresh process (the daemon's): hidden


def test_the_daemon_says_where_its_start_went(tmp_path, model_dir):
    # `status` and the "ready" log line carry the start's phases in ms: the process before serve ran
    # (Python and the imports), the store, the engine (its weights, its KV per token), ...
    d = Daemon(tmp_path, model_dir, fresh=True).start()  # its whole start, imports too
    try:
        c = d.client()
        status = c.call("status")
        phases = status["startup_ms"]
        c.close()
    finally:
        assert d.stop() == 0
    names = ["lock", "store", "engine", "engine.weights", "engine.bundle", "engine.token_bytes", "sessions", "listen"]
    if sys.platform == "linux":  # the process's age comes from /proc
        names.append("process")
        assert phases["process"] > 100  # Python and MLX's imports take more than 0.1 s anywhere
    for name in names:
        assert isinstance(phases[name], float) and phases[name] >= 0, (name, phases)
    engine_parts = sum(v for k, v in phases.items() if k.startswith("engine."))
    assert engine_parts <= phases["engine"] + 1, phases
    ready = [line for line in d.log.read_text().splitlines() if '"event": "ready"' in line]
    assert len(ready) == 1 and json.loads(ready[0])["startup_ms"] == phases
    # the garbage collector's runs are watched from the start on (status.gc)
    assert status["gc"]["frozen"] >= 0
    assert [set(g) for g in status["gc"]["generations"]] == [{"collections", "p50_ms", "p99_ms", "max_ms"}] * 3


def test_the_collectors_runs_are_counted_and_timed_per_generation():
    import gc

    from kvwake.daemon.gcwatch import Collector

    watch = Collector().install()
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        watch.uninstall()
    gc.collect(2)  # not counted: uninstalled
    summary = watch.summary()
    full, young = summary["generations"][2], summary["generations"][0]
    assert full["collections"] == 1 and young["collections"] >= 1
    assert 0 <= full["max_ms"] < 10_000 and full["p50_ms"] == full["max_ms"]


def test_compiled_kernels_are_kept_in_the_users_cache_per_mlx_version(tmp_path, monkeypatch):
    import mlx.core as mx

    from kvwake.daemon.model.kernel_cache import keep_compiled_kernels

    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # platformdirs' user cache folder on Linux
    keep_compiled_kernels()
    if sys.platform == "linux":
        assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "kvwake" / f"mlx-{mx.__version__}" / "ptx")
    assert os.environ["MLX_PTX_CACHE_DIR"].endswith(f"mlx-{mx.__version__}{os.sep}ptx")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/somewhere/else")  # the user's own choice stands
    keep_compiled_kernels()
    assert os.environ["MLX_PTX_CACHE_DIR"] == "/somewhere/else"


SCAN_PROBE = """
import json, os, sys
from kvwake.daemon.imports import hide_unused_frameworks, lighten_imports
import_frameworks = os.environ.get("KVWAKE_IMPORT_FRAMEWORKS") == "1"
if import_frameworks:
    hide_unused_frameworks()  # the scan as transformers ships it, beside the same hidden frameworks
lighten_imports(import_frameworks)
import mlx_lm  # as the daemon does: it imports transformers and its tokenizer classes
from transformers import AutoTokenizer, PreTrainedTokenizerFast
import transformers.utils.import_utils as iu
scan = iu.create_import_structure_from_path  # transformers' own (an lru_cache), or kvwake's front on it
scan = scan if hasattr(scan, "cache_info") else scan.__wrapped__
table = {name: sorted(sys.modules[name]._class_to_module.items()) for name in ("transformers", "transformers.models")}
print(json.dumps({"misses": scan.cache_info().misses, "table": table}))
"""


def test_transformers_reads_its_models_folder_once_then_from_the_cache(tmp_path):
    # Was: transformers 5 read every file of its models folder twice at each import (its scan's cache
    # keyed the folder and the folder's __init__.py apart): a large share of a start. Now once,
    # and a later start loads the table kept in the user's cache folder. The same lazy table every way.
    import transformers

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    folders = sum(1 for _, dirs, _ in os.walk(models) for d in dirs if d != "__pycache__") + 1
    runs = []
    for lighten in (False, True, True):
        env = {k: v for k, v in os.environ.items() if k != "KVWAKE_IMPORT_FRAMEWORKS"}
        env["XDG_CACHE_HOME"] = str(tmp_path)  # platformdirs' user cache folder on Linux
        if not lighten:
            # the switch that leaves transformers' scan as it comes; the probe hides the same frameworks
            # anyway (where torch is installed, a table made with it visible holds torch's classes too)
            env["KVWAKE_IMPORT_FRAMEWORKS"] = "1"
        out = subprocess.run([sys.executable, "-c", SCAN_PROBE], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert folders > 100  # transformers 5 keeps one folder per model family
    plain, first, later = (r["misses"] for r in runs)
    assert plain >= 2 * folders, (plain, folders)  # as transformers comes: twice
    assert first <= folders + 5, (first, folders)  # each folder once
    assert later <= 5, later  # from the cache (a model family's own folder may still be scanned)
    assert runs[1]["table"] == runs[0]["table"] and runs[2]["table"] == runs[0]["table"]
    if sys.platform == "linux":
        assert len(list((tmp_path / "kvwake" / "transformers-scans").glob("*.marshal"))) == 1


def scanner(calls: list[str]):
    """A stand-in for transformers' scan: each folder's files by name, its subfolders through `front`."""
    front = {}

    def scan(path):
        calls.append(path)
        table = {}
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            table[entry.name] = front["scan"](entry.path) if entry.is_dir() else Path(entry.path).read_text()
        return table

    return scan, front


def test_a_kept_scan_is_used_only_while_its_folder_is_unchanged(tmp_path):
    from kvwake.daemon.imports import Scans

    folder = tmp_path / "models"
    (folder / "llama").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "llama" / "modeling_llama.py").write_text("__all__ = ['LlamaModel']")
    cache = tmp_path / "cache"

    def front(calls):
        scan, hook = scanner(calls)
        hook["scan"] = Scans(scan, cache)  # as transformers' own recursive calls go through the module global
        hook["scan"].KEEP_FROM_FILES = 0  # keep even this small folder's table
        return hook["scan"]

    calls = []
    first = front(calls)
    table = first(folder)
    assert calls == [str(folder), str(folder / "llama")]  # the subfolder straight to the scan, not the front
    assert first(folder / "__init__.py") is table and first(f"{folder}/./") is table  # one folder, one name
    assert len(calls) == 2
    again = []
    f = front(again)
    assert f(folder / "__init__.py") == table and f(str(folder)) == table and again == []  # from the disk
    (folder / "llama" / "modeling_llama.py").write_text("__all__ = ['LlamaModel', 'LlamaForCausalLM']")
    changed = []
    assert front(changed)(folder)["llama"]["modeling_llama.py"].endswith("'LlamaForCausalLM']")
    assert changed == [str(folder), str(folder / "llama")]
    kept = list(cache.glob("*.marshal"))
    assert len(kept) == 1  # one file per folder, rewritten
    kept[0].write_bytes(b"torn")
    torn = []
    assert front(torn)(folder) == front([])(folder) and torn == [str(folder), str(folder / "llama")]
