"""Bundle hash: the identity of the model a KV snapshot was computed with.

A snapshot only wakes into the bundle whose hash it names (DESIGN.md,
invariant 4). The hash is sha256 over the canonical JSON of a *description*:

    {"format": 1,                       # version of this layout
     "model_name": "SmolLM2-...",       # display only: NOT hashed
     "weights": {"model.safetensors": "<sha256 hex>", ...},
     "config": {"config.json": ...},
     "tokenizer": {"tokenizer.json": ..., "tokenizer_config.json": ..., ...},
     "chat_template": {"tokenizer_config.json#chat_template": ..., "chat_template.jinja": ...},
     "generation_config": {"generation_config.json": ...},   # {} when absent
     "kv_layout": [{"kind": "kv", "kv_heads": 3, ...}, ...],  # per layer, as given
     "block_tokens": 128, "codec": "planes-zstd", "codec_version": 1}

File groups map a name relative to the model folder to the sha256 of the
file's bytes (symlinks followed: a Hugging Face snapshot of links hashes like
a copy). Counted, top level only: weights = every *.safetensors and
model.safetensors.index.json; config.json (required); TOKENIZER_FILES;
TEMPLATE_FILES; generation_config.json; and the "chat_template" value inside
tokenizer_config.json (sha256 of its UTF-8 text, or of its canonical JSON when
it is a list of named templates). That template is thus counted twice on
purpose: the file digest makes the hash exact, the extra entry lets
`diff_descriptions` say "chat_template". Ignored: everything else (README,
LICENSE, .git and other folders, GGUF files) and kvwake-convert.json, whose
provenance must not split the hash of byte-identical files.

Canonical JSON is `json.dumps(sort_keys=True, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)` of the description without "model_name":
no absolute paths, mtimes or Python `hash()`, so the same bytes give the same
hash in any process, folder or machine. File digests are cached on disk
(kv/digests.py, DigestCache) so a restart does not re-read gigabytes of weights.

A first start reads every counted file once: `start_digests` hashes them on
background threads (one file per thread, the largest first) from the moment
the model folder is known, so the reading overlaps loading the weights (and,
`prestart_digests`, the daemon's imports before it), and
`describe_bundle(digests=...)` joins them when the bundle is needed. A file's
digest is the plain sha256 of its bytes, whatever the threads: the same hash
as ever, so stores made before keep waking. sha256 cannot be split within one
file, so the largest file alone sets the floor of a first start's hashing
(docs/decisions.md, "First start at the disk's speed").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwake.daemon.kv.digests import DigestCache, Hashing

__all__ = [
    "DESCRIPTION_FORMAT", "Bundle", "BundleError", "PendingDigests",
    "DIGEST_CACHE_NAME", "describe_bundle", "digests_ahead", "diff_descriptions", "hash_description",
    "prestart_digests", "start_digests", "start_digests_early",
]

log = logging.getLogger("kvwake.daemon.bundle")  # its name before the layers (logs are read by it)

DESCRIPTION_FORMAT = 1
DIGEST_CACHE_NAME = "digests.json"  # the daemon's digest cache file, in its data dir
DISPLAY_KEYS = ("model_name",)  # in the description, never in the hash

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TEMPLATE_IN_CONFIG = "tokenizer_config.json#chat_template"


class BundleError(Exception):
    """A model folder that cannot be described: missing, or without weights or config."""


@dataclass(frozen=True)
class Bundle:
    """A described model bundle: `hash` (64 hex) over `description` (see module doc)."""

    hash: str
    description: dict

    @property
    def model_name(self) -> str:
        return self.description.get("model_name", "")


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode("ascii")


def hash_description(description: dict) -> str:
    """The bundle hash of a description (display keys such as model_name left out).

    Use it to check that a stored description still matches the hash it is
    filed under. Raises TypeError/ValueError if the description is not JSON-able.
    """
    hashed = {k: v for k, v in description.items() if k not in DISPLAY_KEYS}
    return hashlib.sha256(_canonical(hashed)).hexdigest()


# --- the description -----------------------------------------------------------------


def _template_digest(tokenizer_config: Path) -> str | None:
    """sha256 of the chat template inside tokenizer_config.json, None if it has none."""
    try:
        template = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError) as exc:
        raise BundleError(f"{tokenizer_config} is not a JSON object: {exc}") from exc
    if template is None:
        return None
    data = template.encode("utf-8") if isinstance(template, str) else _canonical(template)
    return hashlib.sha256(data).hexdigest()


def _counted_names(folder: Path) -> dict[str, list[str]]:
    """The counted files present in `folder`, by group (module doc).

    Raises BundleError for a missing folder, no *.safetensors weights or no config.json."""
    if not folder.is_dir():
        raise BundleError(f"model folder {folder} does not exist")
    weights = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not weights:
        raise BundleError(f"no *.safetensors weights in model folder {folder}")
    if not (folder / "config.json").is_file():
        raise BundleError(f"no config.json in model folder {folder}")
    wanted = {
        "weights": [*weights, "model.safetensors.index.json"],
        "config": ["config.json"],
        "tokenizer": list(TOKENIZER_FILES),
        "chat_template": list(TEMPLATE_FILES),
        "generation_config": ["generation_config.json"],
    }
    return {group: [n for n in names if (folder / n).is_file()] for group, names in wanted.items()}


class PendingDigests:
    """The digests of a model folder's counted files, computed on background threads from the moment it is
    made (`start_digests`): `groups()` joins them. Dropped unjoined (a weights load that failed), its threads
    stop at their next read. Errors (BundleError, OSError) are raised by `groups()`, not at the start."""

    def __init__(self, folder: Path, cache: DigestCache | None, workers: int | None = None) -> None:
        self.folder, self.cache = folder, cache
        stop = threading.Event()
        weakref.finalize(self, stop.set)
        try:
            self._names, self._error = _counted_names(folder), None
        except BundleError as exc:
            self._names, self._error = {}, exc
        names = [n for group in self._names.values() for n in group]
        self._hashing = Hashing(folder, names, cache, workers or os.cpu_count() or 1, stop)
        self._futures = self._hashing.futures

    def hurry(self, workers: int | None = None) -> None:
        """Hash on up to `workers` threads from now on (default: one per core), the files still waiting: a load
        that takes digests made ahead on one thread (`digests_ahead`) waits for no slower hashing than its own."""
        self._hashing.add_workers(workers or os.cpu_count() or 1)

    def groups(self) -> dict[str, dict[str, str]]:
        """The description's file groups, once every digest is in (waits); saves the digest cache (a failure
        to save is logged). Raises BundleError (module doc) or OSError from reading a file."""
        if self._error is not None:
            raise self._error
        groups = {group: {n: self._futures[n].result() for n in names} for group, names in self._names.items()}
        if "tokenizer_config.json" in groups["tokenizer"]:
            inner = _template_digest(self.folder / "tokenizer_config.json")
            if inner is not None:
                groups["chat_template"][TEMPLATE_IN_CONFIG] = inner
        if self.cache is not None:
            try:
                self.cache.save()
            except OSError as exc:
                log.warning("could not save digest cache %s: %s", self.cache.path, exc)
        return groups


# Digests started before their engine was made (prestart_digests), by (folder, digest cache file)
_prestarted: dict[tuple[Path, Path | None], PendingDigests] = {}
_prestarted_lock = threading.Lock()


def _key(folder: Path, digest_cache: str | os.PathLike | None) -> tuple[Path, Path | None]:
    return folder, Path(digest_cache).absolute() if digest_cache is not None else None


def _started(folder: Path, digest_cache: str | os.PathLike | None, workers: int | None = None) -> PendingDigests:
    return PendingDigests(folder, DigestCache(digest_cache) if digest_cache is not None else None, workers)


def start_digests(model_dir: str | os.PathLike, *, digest_cache: str | os.PathLike | None = None,
                  workers: int | None = None) -> PendingDigests:
    """Start hashing the counted files of `model_dir` on `workers` threads (default: one per core, at most
    one per file; the largest files first), for `describe_bundle(digests=...)`. The first call for a folder
    and cache that `prestart_digests` or `digests_ahead` started takes those, hashing what is left on up to
    `workers` threads from then on.

    digest_cache: path of a DigestCache file, as describe_bundle takes it. Raises nothing: a folder that
    cannot be described raises when the digests are joined.
    """
    folder = Path(model_dir).resolve()
    with _prestarted_lock:
        early = _prestarted.pop(_key(folder, digest_cache), None)
    if early is None:
        return _started(folder, digest_cache, workers)
    early.hurry(workers)  # made ahead on one thread: the rest as fast as a load's own
    return early


def digests_ahead(folders: list[Path], digest_cache: str | os.PathLike) -> threading.Thread | None:
    """Hash the counted files of `folders` (the other configured models, at the daemon's first start) into the
    digest cache, one file at a time on one thread of its own, for their loads to find cached: an uncached load's
    bundle waited for its digests (most of a small model's load: docs/benchmarks.md, "Several models"), every
    file hashed beside the other models' decoding. Once per machine and per changed file: the cache keeps them
    (by size, times and inode, so a file changed since is hashed again by its load, and the model tie holds). A
    load that comes while its folder is being hashed takes those digests under way (`start_digests`, which
    hashes the rest on its own threads) rather than hashing it again beside them. That thread, None when there
    is none to hash; a folder that fails is left to its load, which reports it."""
    if not folders:
        return None

    def run() -> None:
        started, done = time.perf_counter(), 0
        for folder in folders:
            key = _key(Path(folder).resolve(), digest_cache)
            with _prestarted_lock:
                if key in _prestarted:  # under way already (the start's own, or a load's)
                    continue
                pending = _prestarted[key] = _started(key[0], digest_cache, workers=1)
            try:
                pending.groups()  # every digest in, the cache saved
                done += 1
            except Exception as exc:  # noqa: BLE001 - its load hashes it again and says what is wrong
                log.info("digests not made ahead", extra={"model": str(folder), "error": repr(exc)})
            finally:
                with _prestarted_lock:  # not taken by a load meanwhile: later loads find the cache
                    if _prestarted.get(key) is pending:
                        del _prestarted[key]
        # how long the other models' decode steps had this thread beside them (bench/models.py waits for it)
        log.info("digests made ahead", extra={"models": done, "ms": round((time.perf_counter() - started) * 1000, 1)})

    thread = threading.Thread(target=run, name="kvwake-digests-ahead", daemon=True)
    thread.start()
    return thread


def prestart_digests(model_dir: str | os.PathLike, *, digest_cache: str | os.PathLike | None = None) -> None:
    """Start the digests of `model_dir` before what needs them exists (the daemon, before its heavy
    imports), for the first `start_digests` of the same folder and cache in this process to take. Until
    taken they run to their end; a second prestart of the same pair adds nothing."""
    folder = Path(model_dir).resolve()
    with _prestarted_lock:
        key = _key(folder, digest_cache)
        if key not in _prestarted:
            _prestarted[key] = _started(folder, digest_cache)


def start_digests_early(model: str | None, data_dir: Path) -> bool:
    """Start the bundle's file digests of `model` (the settings' model) on background threads, for the
    engine to take (`prestart_digests`); `serve` calls it after lighten_imports and before its heavy imports
    (this module imports nothing heavy). Only a model given as a folder: the default model is converted
    and a hub id downloaded later, so theirs start with the engine. Says whether it started them."""
    if model is None or not Path(model).expanduser().is_dir():
        return False
    prestart_digests(Path(model).expanduser(), digest_cache=Path(data_dir) / DIGEST_CACHE_NAME)
    return True


def describe_bundle(model_dir: str | os.PathLike, *, kv_layout: list[dict], block_tokens: int,
                    codec: str, codec_version: int, digest_cache: str | os.PathLike | None = None,
                    model_name: str | None = None, digests: PendingDigests | None = None) -> Bundle:
    """Describe and hash the model bundle in `model_dir` (format: module docstring).

    kv_layout: one JSON-able dict per layer (cache kind, kv heads, head dims,
    dtype, window), hashed as given. block_tokens: tokens per block (> 0).
    codec/codec_version: the block codec. digest_cache: path of a DigestCache
    file (created if missing; a failure to save it is logged, not raised).
    model_name: shown to users, not hashed; defaults to the folder's name.
    digests: the files' digests started earlier by `start_digests` for this
    folder (they carry their own cache: digest_cache must then be None);
    without them the files are hashed now, in parallel.
    Raises BundleError for a missing folder, no weights, no config.json or an
    unreadable tokenizer_config.json; ValueError/TypeError for bad arguments.
    """
    folder = Path(model_dir).resolve()
    if type(block_tokens) is not int or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if not isinstance(codec, str) or not codec or type(codec_version) is not int:
        raise ValueError(f"codec must be a name and codec_version an int, got "
                         f"{codec!r}, {codec_version!r}")
    if not isinstance(kv_layout, list) or not all(isinstance(x, dict) for x in kv_layout):
        raise ValueError("kv_layout must be a list of one dict per layer")
    kv_layout = json.loads(_canonical(kv_layout))  # a JSON-able, private copy
    if digests is None:
        digests = start_digests(folder, digest_cache=digest_cache)
    elif digests.folder != folder or digest_cache is not None:
        raise ValueError(f"digests of {digests.folder} given for {folder}, or with a digest_cache "
                         f"({digest_cache!r}): they carry their own")
    if model_name is None:
        model_name = Path(model_dir).name or folder.name
    description = {
        "format": DESCRIPTION_FORMAT,
        "model_name": model_name,
        **digests.groups(),
        "kv_layout": kv_layout,
        "block_tokens": block_tokens,
        "codec": codec,
        "codec_version": codec_version,
    }
    return Bundle(hash=hash_description(description), description=description)


# --- differences ---------------------------------------------------------------------

MAX_LAYER_LINES = 3


def _diff_files(group: str, a: dict, b: dict) -> list[str]:
    out = []
    for name in sorted(a.keys() | b.keys()):
        if name not in b:
            out.append(f"{group} {name} only in first")
        elif name not in a:
            out.append(f"{group} {name} only in second")
        elif a[name] != b[name]:
            out.append(f"{group} {name} differs")
    return out


def _diff_layout(a: list, b: list) -> list[str]:
    out = [] if len(a) == len(b) else [f"kv_layout has {len(a)} layers != {len(b)}"]
    differing = [i for i in range(min(len(a), len(b))) if a[i] != b[i]]
    for i in differing[:MAX_LAYER_LINES]:
        la, lb = a[i], b[i]
        if isinstance(la, dict) and isinstance(lb, dict):
            keys = sorted(k for k in la.keys() | lb.keys() if la.get(k) != lb.get(k))
            detail = ", ".join(f"{k} {la.get(k)!r} != {lb.get(k)!r}" for k in keys)
        else:
            detail = f"{la!r} != {lb!r}"
        out.append(f"kv_layout layer {i} differs ({detail})")
    if len(differing) > MAX_LAYER_LINES:
        out.append(f"kv_layout {len(differing) - MAX_LAYER_LINES} more layers differ")
    return out


def diff_descriptions(a: dict, b: dict) -> list[str]:
    """Human-readable differences between two bundle descriptions, "first" being `a`.

    Only hashed keys are compared: for descriptions made by describe_bundle the
    list is empty exactly when the two hash alike. Lines look like "weights model.safetensors differs",
    "kv_layout layer 3 differs (kv_heads 3 != 4)", "block_tokens 128 != 64".
    """
    out: list[str] = []
    for key in sorted((a.keys() | b.keys()) - set(DISPLAY_KEYS)):
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff_files(key, va, vb)
        elif key == "kv_layout" and isinstance(va, list) and isinstance(vb, list):
            out += _diff_layout(va, vb)
        else:
            out.append(f"{key} {va!r} != {vb!r}")
    return out
