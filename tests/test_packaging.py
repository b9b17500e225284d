"""A plain and an editable install both import every subpackage, even from the repository's root.

Run from the root, Python puts the working directory first on sys.path, so a
top-level folder named `kvwake` there would be imported instead of the
installed package (docs/decisions.md, "Package layout": no folder named kvwake).

Each case installs a copy of the source tree into a fresh venv, offline: the
venv has no pip or setuptools of its own and sees this interpreter's
site-packages (pip, setuptools, every dependency) through a `.pth` file, so
pip builds with `--no-build-isolation --no-index` and checks that the
setuptools it finds satisfies pyproject's build requirement.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Never copied: hidden folders (.git, .venv, caches, .gpu's staged wheels), build output (pip's in-tree
# build writes build/ and *.egg-info) and the Node test's packages; none is needed to build.
SKIP = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "node_modules")
IMPORTS = ("import kvwake.daemon, kvwake.store, kvwake.client, importlib.resources as r; "
           "print(kvwake.daemon.__file__); "
           "assert r.files('kvwake.service_templates').joinpath('kvwake.service').is_file()")


def fresh_venv(path: Path) -> tuple[Path, Path]:
    """A venv without pip that sees this interpreter's packages; returns (python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "kvwake-test-parent.pth").write_text("".join(f"{p}\n" for p in ours))
    return python, site


@pytest.mark.parametrize("editable", [False, True], ids=["plain", "editable"])
def test_subpackages_import_from_the_repository_root(tmp_path, editable):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    python, site = fresh_venv(tmp_path / "venv")
    # pip sees this environment's kvwake too, and leaves it alone: it is outside the fresh venv.
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
               "--check-build-dependencies", *(["-e"] if editable else []), str(src)]
    done = subprocess.run(install, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

    done = subprocess.run([python, "-c", IMPORTS], cwd=src, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    daemon_file = Path(done.stdout.strip())
    if editable:
        assert daemon_file.is_relative_to(src), daemon_file
    else:
        assert daemon_file.is_relative_to(site), daemon_file


def test_no_folder_named_kvwake_at_the_root():
    # Git leaves an ignored __pycache__/ behind when it removes a folder's tracked files; from the
    # root, that bare kvwake/ turns an editable install's kvwake into an empty namespace package.
    assert not (ROOT / "kvwake").exists(), (
        f"{ROOT / 'kvwake'} shadows the installed package from the repository root: the base modules "
        "live in common/ now; remove the folder and run `pip install -e .` again")
