"""What `kvwake serve` does to its imports before it imports anything heavy.

Two things, both before MLX, mlx-lm or transformers load, in `lighten_imports()`:

- Frameworks the daemon never runs are made to look absent (`hide_unused_frameworks`).
- transformers' scan of its `models` folder runs once, not twice, and later starts load its result
  from the user's cache folder (`ScanOnce`, `Scans`).

Neither changes what the daemon computes; both only cut its start. After them, and still before the
heavy imports, `serve` starts reading the model's files for its bundle hash (kv/bundle.py
`start_digests_early`), so the reading overlaps the imports as well as the weights load. The tuning knob import_frameworks
(KVWAKE_IMPORT_FRAMEWORKS=1, `--tune import_frameworks=1`) turns both off: `serve` reads its settings
first, which import nothing heavy.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import marshal
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from kvwake.paths import default_cache_dir

__all__ = ["UNUSED_FRAMEWORKS", "ScanOnce", "Scans", "hide_unused_frameworks", "lighten_imports"]

# Frameworks the daemon never runs (it runs MLX) that its libraries import when they are installed:
# transformers' tokenizer imports load PyTorch and torchvision (most of a start where they are installed,
# bench/startup_spy.sh); sqlite-utils imports pandas, and with it pyarrow, only to name a pandas type
# (docs/history/benchmarks-journal.md, "CUDA start-up (issue 23, point 6)").
UNUSED_FRAMEWORKS = ("torch", "torchvision", "torchaudio", "tensorflow", "flax", "jax", "pandas", "pyarrow")


def lighten_imports(import_frameworks: bool = False) -> None:
    """Both cuts, unless `import_frameworks` (the tuning knob), or transformers is imported already (then
    neither can take effect, and hiding a framework would break it: see hide_unused_frameworks)."""
    if import_frameworks or "transformers" in sys.modules:
        return
    hide_unused_frameworks()
    ScanOnce.install()


def hide_unused_frameworks() -> None:
    """Make UNUSED_FRAMEWORKS look absent to this process (None in sys.modules: find_spec, which
    transformers asks, says None and an import fails), unless transformers is imported: it decides what is
    available once, at its import, and a framework hidden after that breaks it (`serve` run in a test
    process that had imported transformers: its next model load failed importing torchvision.io and
    LlamaConfig; docs/decisions.md, "Daemon"). One imported already stays."""
    if "transformers" in sys.modules:
        return
    for name in UNUSED_FRAMEWORKS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


class ScanOnce(importlib.abc.MetaPathFinder):
    """transformers (5.x) builds its lazy import table by reading every file of its `models` folder
    (over a thousand files) at each import, and twice: `transformers/__init__.py` asks for the folder,
    `transformers/models/__init__.py` for its `__init__.py`, and the scan's cache (`lru_cache` on
    `create_import_structure_from_path`) keys the two apart: about half of a small daemon's start
    (docs/history/benchmarks-journal.md, "CUDA start-up (issue 23, point 6)").

    This finder waits for `transformers.utils.import_utils` to load (found by the finders after it, as it
    would have been), then puts a `Scans` front on that function. If the function is not there (another
    transformers), or the module does not come from a plain source file (a zip's loader is shared by all
    its modules), nothing changes.
    """

    MODULE = "transformers.utils.import_utils"
    FUNCTION = "create_import_structure_from_path"

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.done = False

    @classmethod
    def install(cls, cache_dir: Path | None = None) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls(cache_dir or default_cache_dir() / "transformers-scans"))

    def find_spec(self, name: str, path, target=None):  # noqa: ANN001 (the finder protocol's own types)
        if self.done or name != self.MODULE:
            return None
        self.done = True  # the module loads once (it stays in sys.meta_path: removing it mid-search skips a finder)
        spec = next((found for finder in list(sys.meta_path) if finder is not self and hasattr(finder, "find_spec")
                     and (found := finder.find_spec(name, path, target)) is not None), None)
        if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            scan = getattr(module, self.FUNCTION, None)
            if callable(scan):
                setattr(module, self.FUNCTION, Scans(scan, self.cache_dir, reader=getattr(module, "__file__", None)))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  (this spec's own loader)
        return spec


class Scans:
    """A front on transformers' folder scan:

    - A folder is named one way (absolute, normalised; a file is its folder, as the scan itself treats
      it), so the second ask for `models` returns the first's table.
    - A big folder's table is kept on disk (`<cache_dir>/<hash of the folder's path>.marshal`) with a
      fingerprint: every file's path, size and modification time under the folder, and those of the
      scanning code's own file and this Python's version (far quicker to take than a scan). A later start
      whose fingerprint matches loads the table instead of reading every file; any other fingerprint (an upgrade, an edited file) scans and writes it again. `marshal`, not
      pickle: the table is dicts, sets and strings, and loading one runs no code. A file that cannot be
      read or written only costs the scan.

    Only a scan asked from outside goes through here; the scan's calls into its own subfolders go
    straight to transformers' function.
    """

    KEEP_FROM_FILES = 100  # a folder of fewer files is scanned each time (a model family's own: milliseconds)

    def __init__(self, scan, cache_dir: Path, reader: str | None = None) -> None:  # noqa: ANN001 (transformers')
        self.__wrapped__ = scan
        self.cache_dir = cache_dir
        self.reader = reader  # the scanning code's file: part of the fingerprint
        self.tables: dict[str, object] = {}
        self.inside = threading.local()

    def __call__(self, module_path):  # noqa: ANN001, ANN204 (the signature transformers calls)
        if getattr(self.inside, "depth", 0):  # a subfolder of a scan under way
            return self.__wrapped__(module_path)
        path = os.path.normpath(os.path.abspath(os.fspath(module_path)))
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if path not in self.tables:
            self.inside.depth = 1
            try:
                self.tables[path] = self.load_or_scan(path)
            finally:
                self.inside.depth = 0
        return self.tables[path]

    def load_or_scan(self, path: str):  # noqa: ANN201 (transformers' table)
        kept = self.cache_dir / f"{hashlib.blake2b(path.encode(), digest_size=16).hexdigest()}.marshal"
        try:
            now, files = fingerprint(path, self.reader)
        except OSError:
            return self.__wrapped__(path)
        try:
            was, table = marshal.loads(kept.read_bytes())
            if was == now:
                return table
        except Exception:  # noqa: BLE001 (absent, torn or from another version: scan instead)
            pass
        table = self.__wrapped__(path)
        if files >= self.KEEP_FROM_FILES:
            temp = None
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.cache_dir, suffix=".tmp", delete=False) as f:
                    temp = f.name
                    f.write(marshal.dumps((now, table)))
                os.replace(temp, kept)
            except Exception:  # noqa: BLE001 (unwritable, or a table marshal cannot hold: the scan stands)
                if temp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(temp)
        return table


def fingerprint(folder: str, reader: str | None = None) -> tuple[str, int]:
    """(a hash of every file's relative path, size and modification time under `folder` but __pycache__,
    of `reader`'s and of this Python's version; the number of files)."""
    h = hashlib.blake2b(f"{sys.version}\0{reader}\0".encode(), digest_size=20)
    if reader is not None:
        st = os.stat(reader)
        h.update(f"{st.st_size}\0{st.st_mtime_ns}\n".encode())
    pending, files = [folder], 0
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    pending.append(entry.path)
                else:
                    st = entry.stat()
                    files += 1
                    h.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest(), files
