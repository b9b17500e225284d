"""What `kvwake serve` does to its imports before it imports anything heavy (issue 23, point 6).

Two things, both before MLX, mlx-lm or transformers load, in `lighten_imports()`:

- Frameworks the daemon never runs are made to look absent (`hide_unused_frameworks`).
- transformers' scan of its `models` folder runs once, not twice, and later starts load its result
  from the user's cache folder (`ScanOnce`, `Scans`).

Neither changes what the daemon computes; both only cut its start. KVWAKE_IMPORT_FRAMEWORKS=1 turns
both off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from kvwake.paths import default_cache_dir

__all__ = ["UNUSED_FRAMEWORKS", "ScanOnce", "Scans", "hide_unused_frameworks", "lighten_imports"]

# Frameworks the daemon never runs (it runs MLX) that its libraries import when they are installed:
# transformers' tokenizer imports load PyTorch and torchvision (10+ s of a start on the GPU machine,
# bench/startup_spy.sh); sqlite-utils imports pandas, and with it pyarrow, only to name a pandas type
# (0.6 s there).
UNUSED_FRAMEWORKS = ("torch", "torchvision", "torchaudio", "tensorflow", "flax", "jax", "pandas", "pyarrow")


def lighten_imports() -> None:
    """Both cuts, unless KVWAKE_IMPORT_FRAMEWORKS=1, or transformers is imported already (then neither
    can take effect, and hiding a framework would break it: see hide_unused_frameworks)."""
    if os.environ.get("KVWAKE_IMPORT_FRAMEWORKS") == "1" or "transformers" in sys.modules:
        return
    hide_unused_frameworks()
    ScanOnce.install()


def hide_unused_frameworks() -> None:
    """Make UNUSED_FRAMEWORKS look absent to this process (None in sys.modules: find_spec, which
    transformers asks, says None and an import fails), unless transformers is imported: it decides what is
    available once, at its import, and a framework hidden after that breaks it (seen on the GPU machine:
    `serve` run in a test process that had imported transformers, whose next model load failed importing
    torchvision.io and LlamaConfig). One imported already stays."""
    if "transformers" in sys.modules:
        return
    for name in UNUSED_FRAMEWORKS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


class ScanOnce(importlib.abc.MetaPathFinder):
    """transformers (5.x) builds its lazy import table by reading every file of its `models` folder
    (1,698 files in 5.24) at each import, and twice: `transformers/__init__.py` asks for the folder,
    `transformers/models/__init__.py` for its `__init__.py`, and the scan's cache (`lru_cache` on
    `create_import_structure_from_path`) keys the two apart. Here that was 0.55-0.7 s of a 1.3 s start.

    This finder waits for `transformers.utils.import_utils` to load, then puts a `Scans` front on that
    function. If the function is not there (another transformers), nothing changes.
    """

    MODULE = "transformers.utils.import_utils"
    FUNCTION = "create_import_structure_from_path"

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir

    @classmethod
    def install(cls, cache_dir: Path | None = None) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls(cache_dir or default_cache_dir() / "transformers-scans"))

    def find_spec(self, name: str, path, target=None):  # noqa: ANN001 (the finder protocol's own types)
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)  # once: the module is loaded once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            scan = getattr(module, self.FUNCTION, None)
            if callable(scan):
                setattr(module, self.FUNCTION, Scans(scan, self.cache_dir))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


class Scans:
    """A front on transformers' folder scan:

    - A folder is named one way (a file is its folder, as the scan itself treats it), so the second ask
      for `models` returns the first's table.
    - A folder's table is kept on disk (`<cache_dir>/<hash of the folder's path>.pickle`) with the
      folder's fingerprint: every file's path, size and modification time under it (15-20 ms to take
      for `models`, against 0.3 s to scan it here). A later start whose fingerprint matches loads the
      table instead of reading 1,698 files; any other fingerprint (an upgrade, an edited file) scans
      and writes it again. A file that cannot be read or written only costs the scan.

    Only a scan asked from outside goes through here; the scan's calls into its own subfolders go
    straight to transformers' function.
    """

    WORTH_KEEPING_S = 0.05  # a folder whose scan takes less is not written to disk

    def __init__(self, scan, cache_dir: Path) -> None:  # noqa: ANN001 (transformers' function)
        self.__wrapped__ = scan
        self.cache_dir = cache_dir
        self.tables: dict[str, object] = {}
        self.inside = threading.local()

    def __call__(self, module_path):  # noqa: ANN001, ANN204 (the signature transformers calls)
        path = os.fspath(module_path)
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if getattr(self.inside, "depth", 0):  # a subfolder of a scan under way
            return self.__wrapped__(path)
        if path not in self.tables:
            self.inside.depth = 1
            try:
                self.tables[path] = self.load_or_scan(path)
            finally:
                self.inside.depth = 0
        return self.tables[path]

    def load_or_scan(self, path: str):  # noqa: ANN201 (transformers' table)
        kept = self.cache_dir / f"{hashlib.blake2b(path.encode(), digest_size=16).hexdigest()}.pickle"
        try:
            now = fingerprint(path)
        except OSError:
            return self.__wrapped__(path)
        try:
            with open(kept, "rb") as f:
                was, table = pickle.load(f)
            if was == now:
                return table
        except Exception:  # noqa: BLE001 (absent, torn or from another version: scan instead)
            pass
        t0 = time.perf_counter()
        table = self.__wrapped__(path)
        if time.perf_counter() - t0 >= self.WORTH_KEEPING_S:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.cache_dir, suffix=".tmp", delete=False) as f:
                    pickle.dump((now, table), f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(f.name, kept)
            except OSError:
                with contextlib.suppress(OSError, NameError):
                    os.unlink(f.name)
        return table


def fingerprint(folder: str) -> str:
    """Every file's relative path, size and modification time under `folder` (but __pycache__), hashed."""
    h = hashlib.blake2b(digest_size=20)
    pending = [folder]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    pending.append(entry.path)
                else:
                    st = entry.stat()
                    h.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
