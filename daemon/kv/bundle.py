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
(DigestCache) so a restart does not re-read gigabytes of weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwake.store.files import sync

__all__ = [
    "DESCRIPTION_FORMAT", "Bundle", "BundleError", "DigestCache",
    "describe_bundle", "diff_descriptions", "file_digest", "hash_description",
]

log = logging.getLogger("kvwake.daemon.bundle")  # its name before the layers (logs are read by it)

DESCRIPTION_FORMAT = 1
CACHE_FORMAT = 1
DISPLAY_KEYS = ("model_name",)  # in the description, never in the hash

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TEMPLATE_IN_CONFIG = "tokenizer_config.json#chat_template"

# A file modified this recently may change again within one mtime tick without
# its (size, mtime) changing (2 s: exFAT/FAT; HFS+ has 1 s); its digest is not
# cached ("racy git" problem).
RACY_WINDOW_NS = 2_000_000_000


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


# --- file digests ------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    """sha256 hex of a file's bytes, read in chunks (never whole into memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


class DigestCache:
    """sha256 of files, persisted as a small JSON file so restarts skip re-hashing.

    An entry is keyed by the file's resolved path and trusted only while its
    size, mtime_ns, ctime_ns and inode are unchanged (ctime and inode also catch
    a file replaced by rename or with its mtime set back). Digests of files
    modified within RACY_WINDOW_NS of hashing are not recorded. `path=None`
    keeps the cache in memory only.

    File format: {"format": 1, "entries": {"<resolved path>": {"size": int,
    "mtime_ns": int, "ctime_ns": int, "ino": int, "sha256": "<hex>"}}}.
    An unreadable or malformed file is treated as empty. `save()` merges with
    what is on disk, drops entries of files that no longer exist, and writes a
    temp file then renames it: two processes saving at once leave valid JSON
    (the last writer wins any conflicting entry).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._entries: dict[str, dict] = self._read()
        self._new: dict[str, dict] = {}

    def _read(self) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            entries = data["entries"] if data.get("format") == CACHE_FORMAT else {}
            return {p: e for p, e in entries.items() if _valid_entry(e)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("digest cache %s unreadable (%s); starting empty", self.path, exc)
            return {}

    def lookup(self, path: Path, st: os.stat_result) -> str | None:
        """The cached digest of resolved `path` if `st` matches its entry, else None."""
        entry = self._entries.get(str(path))
        if entry and {k: entry[k] for k in _stat_key(st)} == _stat_key(st):
            return entry["sha256"]
        return None

    def record(self, path: Path, st: os.stat_result, digest: str) -> None:
        """Remember `digest` for resolved `path` as it was when stat'ed as `st`."""
        entry = {**_stat_key(st), "sha256": digest}
        self._entries[str(path)] = entry
        self._new[str(path)] = entry

    def save(self) -> None:
        """Write new entries to disk (no-op if none or in-memory). Raises OSError."""
        if self.path is None or not self._new:
            return
        merged = {**self._read(), **self._new}
        merged = {p: e for p, e in merged.items() if os.path.exists(p)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_canonical({"format": CACHE_FORMAT, "entries": merged}))
                f.flush()
                sync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._entries, self._new = merged, {}


def _valid_entry(entry: Any) -> bool:
    return (isinstance(entry, dict)
            and all(type(entry.get(k)) is int for k in ("size", "mtime_ns", "ctime_ns", "ino"))
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)


def file_digest(path: str | os.PathLike, *, cache: DigestCache | None = None) -> str:
    """sha256 hex of the file at `path` (symlinks followed), via `cache` when it is fresh.

    Raises OSError (FileNotFoundError, IsADirectoryError, ...) from reading.
    """
    resolved = Path(path).resolve()
    before = resolved.stat()
    if cache is not None and (hit := cache.lookup(resolved, before)) is not None:
        return hit
    started = time.time_ns()
    digest = _sha256_file(resolved)
    if cache is not None:
        after = resolved.stat()
        settled = before.st_mtime_ns < started - RACY_WINDOW_NS
        if settled and _stat_key(after) == _stat_key(before):
            cache.record(resolved, before, digest)
    return digest


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


def _file_groups(folder: Path, cache: DigestCache | None) -> dict[str, dict[str, str]]:
    def digests(names: list[str]) -> dict[str, str]:
        return {n: file_digest(folder / n, cache=cache) for n in names if (folder / n).is_file()}

    weights = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not weights:
        raise BundleError(f"no *.safetensors weights in model folder {folder}")
    if not (folder / "config.json").is_file():
        raise BundleError(f"no config.json in model folder {folder}")
    groups = {
        "weights": digests([*weights, "model.safetensors.index.json"]),
        "config": digests(["config.json"]),
        "tokenizer": digests(list(TOKENIZER_FILES)),
        "chat_template": digests(list(TEMPLATE_FILES)),
        "generation_config": digests(["generation_config.json"]),
    }
    if (folder / "tokenizer_config.json").is_file():
        inner = _template_digest(folder / "tokenizer_config.json")
        if inner is not None:
            groups["chat_template"][TEMPLATE_IN_CONFIG] = inner
    return groups


def describe_bundle(model_dir: str | os.PathLike, *, kv_layout: list[dict], block_tokens: int,
                    codec: str, codec_version: int, digest_cache: str | os.PathLike | None = None,
                    model_name: str | None = None) -> Bundle:
    """Describe and hash the model bundle in `model_dir` (format: module docstring).

    kv_layout: one JSON-able dict per layer (cache kind, kv heads, head dims,
    dtype, window), hashed as given. block_tokens: tokens per block (> 0).
    codec/codec_version: the block codec. digest_cache: path of a DigestCache
    file (created if missing; a failure to save it is logged, not raised).
    model_name: shown to users, not hashed; defaults to the folder's name.
    Raises BundleError for a missing folder, no weights, no config.json or an
    unreadable tokenizer_config.json; ValueError/TypeError for bad arguments.
    """
    folder = Path(model_dir).resolve()
    if not folder.is_dir():
        raise BundleError(f"model folder {folder} does not exist")
    if type(block_tokens) is not int or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if not isinstance(codec, str) or not codec or type(codec_version) is not int:
        raise ValueError(f"codec must be a name and codec_version an int, got "
                         f"{codec!r}, {codec_version!r}")
    if not isinstance(kv_layout, list) or not all(isinstance(x, dict) for x in kv_layout):
        raise ValueError("kv_layout must be a list of one dict per layer")
    kv_layout = json.loads(_canonical(kv_layout))  # a JSON-able, private copy
    cache = DigestCache(digest_cache) if digest_cache is not None else None
    if model_name is None:
        model_name = Path(model_dir).name or folder.name
    description = {
        "format": DESCRIPTION_FORMAT,
        "model_name": model_name,
        **_file_groups(folder, cache),
        "kv_layout": kv_layout,
        "block_tokens": block_tokens,
        "codec": codec,
        "codec_version": codec_version,
    }
    if cache is not None:
        try:
            cache.save()
        except OSError as exc:
            log.warning("could not save digest cache %s: %s", cache.path, exc)
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
