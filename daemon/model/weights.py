"""A model's weights read so that a load lets the other models' engine threads run: off the GIL, and on CUDA
without slowing their decode steps.

`mlx_lm.load` evaluates every parameter in one `mx.eval`, and reading the weights holds the GIL for long
stretches of that call: while a second model loads, the first one's engine thread waits for the GIL at each
step. Here the model is built lazily and its weights are read a piece at a time, two ways (`READS`):

- "mapped" (CUDA's default): each tensor kvwake finds in the model's safetensors files as it is stored is read
  by this module into a staging slot of managed memory kept on the host and mapped for the GPU (kv/devplanes.py's
  staging, as a wake's ring), and a GPU op copies it into the tensor's device memory, reading the slot in place.
  MLX's own load reads into pageable memory and copies it with `cudaMemcpyAsync`, and beside another model's
  decode steps those copies slowed the steps several times over; a copy from managed memory the GPU faults in,
  more; the mapped slot about as little as reading the file alone (bench/load_interference.py; docs/benchmarks.md,
  "Several models"). It is also the faster read.
- "mlx": MLX's own, evaluated in pieces of whole tensors up to PIECE_BYTES (a tensor larger than that is a piece
  of its own), so a GIL wait is at most one piece's read. Elsewhere than CUDA it is the default: on unified
  memory (Metal) or the CPU, MLX reads the file into the array's memory once, where a slot would copy twice.

Which tensors the mapped way reads is found by identity, not by name: mlx-lm's `load_model` hands the arrays
its `mx.load` made to the model class's `sanitize` (hooked here for that call) and then to the model; a
parameter that is still one of those objects, and still nothing but mx.load's read (an in-place operator keeps
the object: `_bare_load`), is that file tensor's bytes, unchanged. Anything `sanitize` made or changed, and any
tensor of a dtype this module does not map, is evaluated MLX's way.
docs/decisions.md, "Several models (issue 53)", says what was measured.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_config, load_model, load_tokenizer

from kvwake.daemon.kv import cudart, devplanes
from kvwake.daemon.kv.digests import stat_key
from kvwake.daemon.kv.restore_buffers import MX_DTYPES
from kvwake.daemon.model.chat import ChatTemplate
from kvwake.daemon.model.kernel_cache import safetensors_header
from kvwake.daemon.timing import Phases

__all__ = ["PIECE_BYTES", "READS", "SLOT_BYTES", "builds_ahead", "default_read", "load", "load_count", "pieces",
           "preload", "prepare", "prepared", "tokenizer_of"]

log = logging.getLogger("kvwake.models")

PIECE_BYTES = 32 << 20  # a piece's bytes: a 1B model's largest tensor, so its pieces are mostly one tensor each
# a mapped read's staging slot (two, so the file's next chunk is read while the GPU copies the last); a larger
# tensor is read in chunks of this size, joined on the device
SLOT_BYTES = 32 << 20
READS = ("mapped", "mlx")
_UNITS = ((4, mx.uint32), (2, mx.uint16), (1, mx.uint8))  # the widest unit a chunk's copy moves


def default_read() -> str:
    """The way weights are read here: "mapped" where MLX runs on CUDA, else "mlx" (module docstring)."""
    return "mapped" if cudart.on_cuda() else "mlx"


def load(path: str, most: int = PIECE_BYTES, phases: Phases | None = None,
         timeline: list[dict[str, Any]] | None = None, read: str | None = None) -> tuple[Any, Any]:
    """mlx-lm's (model, tokenizer) of the model folder `path`, its weights read `read`'s way (READS; None: by
    the backend, `default_read`); `phases` gets "modules" (the model built lazily, its tokenizer read) marked
    before the weights are read, and `timeline` each piece: `at_ms` (from `phases`' start, else from this
    call), `ms`, `bytes`, `read` (its way) -- to line the pieces up against what other models' clients saw
    meanwhile (bench/models.py). A piece of the mapped way is a chunk of a file's bytes. Read the mapped way,
    a model the first start built ahead (`prepare`) is taken instead of built, while its files are unchanged."""
    read = read or default_read()
    if read not in READS:
        raise ValueError(f"weights are read {' or '.join(READS)}, not {read!r}")
    clock = phases if phases is not None else Phases()
    model_path = Path(path)
    index = _index(model_path) if read == "mapped" else {}
    taken = _take_prepared(model_path, index) if read == "mapped" else None
    built, plan = taken if taken is not None else (_build(model_path), None)
    model, config, stored = built  # stored: what mlx-lm's mx.load made, id -> (its name, the array)
    tokenizer = tokenizer_of(model_path, config.get("eos_token_id", None))
    if phases is not None:
        phases.mark("modules")
    params = tree_flatten(model.parameters())
    rest = [v for _, v in params]
    if read == "mapped" and stored:
        rest = _read_mapped(model, plan or _mapped(params, stored, index), clock, timeline)
    stored.clear()
    for piece in pieces(rest, most):
        began = time.perf_counter()
        mx.eval(piece)
        if timeline is not None:
            timeline.append({"at_ms": clock.elapsed_ms(began), "ms": round((time.perf_counter() - began) * 1000, 2),
                             "bytes": sum(a.nbytes for a in piece), "read": "mlx"})
    return model, tokenizer


def _build(model_path: Path) -> tuple[Any, dict, dict[int, tuple[str, mx.array]]]:
    """mlx-lm's model of the folder built lazily (nothing read), its config, and what its mx.load made."""
    stored: dict[int, tuple[str, mx.array]] = {}
    model, config = load_model(model_path, lazy=True, get_model_classes=_recording(stored))
    model.__class__ = getattr(type(model), "_kvwake_plain", type(model))  # its own class back
    return model, config, stored


# Models built ahead (`prepare`), each taken by one load: folder -> (its files' names, sizes and times, the built)
_prepared: dict[str, tuple[tuple, tuple[Any, dict, dict[int, tuple[str, mx.array]]]]] = {}
_prepared_lock = threading.Lock()
_loads: Counter[str] = Counter()  # loads begun per folder (mapped): a `prepare` that saw one begin keeps nothing


def builds_ahead(read: str | None = None) -> bool:
    """Whether models are built ahead where weights are read `read`'s way (None: by the backend): the mapped way
    only, where every parameter is read anew by the engine thread (`prepare`)."""
    return (read or default_read()) == "mapped"


def prepare(path: Path, read: str | None = None, began: int | None = None) -> bool:
    """Build the model of folder `path` now (mlx-lm's modules, lazily: nothing read) for its next load to take,
    where weights are read the mapped way (CUDA). Built at a load, its modules were tens of ms of Python and of
    mx.load's headers beside the other models' decoding, which stalled every stream of theirs at the load's start
    (docs/benchmarks.md, "Several models"); the first start builds the other configured models' ahead
    (`preload`), while nothing decodes, and an unloaded model's are built again while no model is in use
    (sessions/models.py). MLX evaluates an array on the stream of the thread that made it, and on CUDA no other
    thread has that stream: the arrays the modules hold besides their parameters (a RoPE's frequencies) are
    evaluated here, and the load takes the model only if its reads replace every parameter (`_take_prepared`).
    Not kept when a load of the folder began meanwhile, since `began` (its count of loads begun, `load_count`,
    taken when the build was asked for; default: now): that load built its own, and this one would hold the
    files open for nothing until the next. Whether it was built (False: not read the mapped way, `read` or by the
    backend)."""
    if not builds_ahead(read):
        return False
    key = str(Path(path).resolve())
    if began is None:
        began = load_count(path)
    files = _folder_files(Path(path))
    built = _build(Path(path))
    mx.eval(_held_besides_parameters(built[0]))
    with _prepared_lock:
        kept = _loads[key] == began
        replaced = _prepared.pop(key, None) if kept else None
        if kept:
            _prepared[key] = (files, built)
    if not kept:
        _let_go(built)
    if replaced is not None:  # built before and not taken: this one, newer, takes its place
        _let_go(replaced[1])
    return kept


def load_count(path: Path) -> int:
    """How many loads of folder `path` the mapped way began in this process (`prepare`'s `began`)."""
    with _prepared_lock:
        return _loads[str(Path(path).resolve())]


def prepared(path: Path) -> bool:
    """Whether a model of folder `path` built ahead waits for its load."""
    with _prepared_lock:
        return str(Path(path).resolve()) in _prepared


def _take_prepared(model_path: Path, index: dict) -> tuple[tuple[Any, dict, dict[int, tuple[str, mx.array]]],
                                                          tuple] | None:
    """The model `prepare` built for this folder, taken (once), with its mapped reads' plan (`_mapped`), if its
    files are as they were then and those reads replace every parameter it holds (one left would be evaluated on
    the engine thread, on the stream of the thread that built it: refused on CUDA); else None (built again by
    the load). Either way the folder's load has begun: a `prepare` under way keeps nothing."""
    key = str(model_path.resolve())
    with _prepared_lock:
        _loads[key] += 1
        kept = _prepared.pop(key, None)
    if kept is None:
        return None
    files, built = kept
    model, _, stored = built
    plan = _mapped(tree_flatten(model.parameters()), stored, index)
    if files != _folder_files(model_path) or plan[2] or not all(_evaluated(a) for a in _held_besides_parameters(model)):
        log.info("model built ahead not taken", extra={"model": str(model_path)})
        _let_go(built)
        return None
    return built, plan


def _held_besides_parameters(model: Any) -> list[mx.array]:
    """The arrays a model's modules hold that are not its parameters (a RoPE's frequencies: in dicts, lists and
    tuples too)."""
    params = {id(v) for _, v in tree_flatten(model.parameters())}
    held = model.filter_and_map(lambda _m, _k, v: isinstance(v, (dict, list, tuple, mx.array)))
    return [v for _, v in tree_flatten(held) if isinstance(v, mx.array) and id(v) not in params]


def _evaluated(a: mx.array) -> bool:
    """Whether `a` holds its values, no graph left behind it."""
    return _primitives(a) == []


def _let_go(built: tuple[Any, dict, dict[int, tuple[str, mx.array]]]) -> None:
    """Drop what a model built ahead and not taken holds: its lazily loaded arrays keep their files open, and its
    modules sit in reference cycles that only a full collection would free (which a load's frozen objects escape)."""
    model, _, stored = built
    stored.clear()
    for module in model.modules():
        module.clear()


def _folder_files(path: Path, weights: bool = True) -> tuple:
    """What says a model folder (without `weights`: its files but the safetensors) may have changed: its files'
    names, sizes, times and inodes (what the digest cache checks, kv/digests.py)."""
    return tuple((f.name, tuple(stat_key(f.stat()).values())) for f in sorted(path.iterdir())
                 if f.is_file() and (weights or not f.name.endswith(".safetensors")))


# Tokenizers read, kept for the process: (folder, eos ids) -> (its tokenizer files' sizes and times, tokenizer)
_tokenizers: dict[tuple[str, str], tuple[tuple, Any]] = {}
_tokenizers_lock = threading.Lock()
_reading: dict[tuple[str, str], threading.Lock] = {}  # per key: held while its tokenizer is checked or read


def tokenizer_of(path: Path, eos_token_ids: Any = None) -> Any:
    """mlx-lm's tokenizer of the model folder `path`, read once for the process while its files stay as they are.
    Reading one holds the GIL for long stretches (its vocabulary listed three times, its JSON parsed in Python),
    and done in a load it stopped every other loaded model's decode steps (docs/decisions.md, "Several
    models"): kept, a reload reads none, and the first start reads the other configured models' (`preload`)
    while nothing decodes. The engine only reads a tokenizer (each call
    takes a fresh detokenizer), so one object serves every load of its model. A read of the same folder under way
    (read ahead while it loads) is waited for, not done twice."""
    key = (str(Path(path).resolve()), repr(eos_token_ids))
    with _tokenizers_lock:
        reading = _reading.setdefault(key, threading.Lock())
    with reading:
        files = _folder_files(Path(path), weights=False)
        with _tokenizers_lock:
            kept = _tokenizers.get(key)
        if kept is not None and kept[0] == files:
            return kept[1]
        tokenizer = load_tokenizer(Path(path), eos_token_ids=eos_token_ids)
        with _tokenizers_lock:
            _tokenizers[key] = (files, tokenizer)
        if kept is not None:  # replaced: its template (and the pieces it keeps) go with it
            ChatTemplate.forget(kept[1])
        return tokenizer


def preload(paths: list[Path], modules: bool = True, read: str | None = None) -> threading.Thread | None:
    """Read the tokenizers of the model folders `paths` (each as its load will ask: the eos ids of mlx-lm's
    `load_config`, which takes generation_config.json's over config.json's, as `load_model` does), make their
    chat templates (`ChatTemplate.of`) and, with `modules` where weights are read the mapped way (`read`, else by
    the backend), build their models (`prepare`), on a thread of its own, the daemon's first start going on
    meanwhile; that thread, None when there is none to read. A folder that fails is left to its load, which
    reports it."""
    if not paths:
        return None

    building = modules and builds_ahead(read)
    began = {path: load_count(path) for path in paths} if building else {}  # as asked: a load from now on wins

    def make() -> None:
        started, done, built = time.perf_counter(), 0, 0
        try:
            for path in paths:
                try:
                    # and its chat template's probes (model/chat.py), which a load made beside the decoding too
                    ChatTemplate.of(tokenizer_of(path, load_config(path).get("eos_token_id", None)))
                    done += 1
                except Exception as exc:  # noqa: BLE001 - its load reads it again and says what is wrong
                    log.info("tokenizer not read ahead", extra={"model": str(path), "error": repr(exc)})
                    continue
                try:
                    built += building and prepare(path, read, began[path])
                except Exception as exc:  # noqa: BLE001 - its load builds it and says what is wrong
                    log.info("model not built ahead", extra={"model": str(path), "error": repr(exc)})
        finally:
            if building:  # its stream let go of by the thread that made it (model/loader.py release_mlx_streams)
                mx.synchronize()
                mx.clear_streams()
        # how long: past the start's own load, this thread held the GIL beside the first requests
        ms = round((time.perf_counter() - started) * 1000, 1)
        log.info("tokenizers read ahead", extra={"models": done, "built": built, "ms": ms})

    thread = threading.Thread(target=make, name="kvwake-preload", daemon=True)
    thread.start()
    return thread


def _recording(stored: dict[int, tuple[str, mx.array]]) -> Any:
    """mlx-lm's model classes for a config, the model class's `sanitize` first noting every array it is handed
    (mx.load's, by name) in `stored`; the model's own class given back once it is built (`load`)."""
    from mlx_lm.utils import _get_classes  # noqa: PLC0415 - load_model's default, the one mlx_lm.load uses

    def classes(config: dict) -> tuple[type, type]:
        model_class, args_class = _get_classes(config=config)

        def sanitize(self: Any, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            stored.update({id(v): (k, v) for k, v in weights.items()})
            plain = super(recording, self)
            return plain.sanitize(weights) if hasattr(plain, "sanitize") else weights

        recording = type(model_class.__name__, (model_class,), {"sanitize": sanitize, "_kvwake_plain": model_class})
        return recording, args_class

    return classes


def _index(model_path: Path) -> dict[str, tuple[Path, int, int, Any, tuple[int, ...]]]:
    """Every tensor of the folder's safetensors files: name -> (file, offset, bytes, MLX dtype or None (one the
    store does not name: read MLX's way), shape), from their headers."""
    index = {}
    for file in sorted(model_path.glob("model*.safetensors")):
        header, base = safetensors_header(file)
        for name, t in header.items():
            first, end = t["data_offsets"]
            index[name] = (file, base + first, end - first, MX_DTYPES.get(t["dtype"]), tuple(t["shape"]))
    return index


def _mapped(params: list[tuple[str, mx.array]], stored: dict[int, tuple[str, mx.array]],
            index: dict) -> tuple[dict[int, list[str]], dict[int, tuple], list[mx.array]]:
    """Which parameters are file tensors as stored: by id, their keys and their file tensor; and the others."""
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, tuple] = {}
    rest = []
    for key, v in params:
        name = stored.get(id(v), (None,))[0]
        t = index.get(name) if name is not None else None
        if t is not None and t[3] == v.dtype and t[4] == tuple(v.shape) and t[2] == v.nbytes and _bare_load(v):
            by_id.setdefault(id(v), []).append(key)
            tensors[id(v)] = t
        else:
            rest.append(v)
    return by_id, tensors, rest


def _read_mapped(model: Any, plan: tuple[dict[int, list[str]], dict[int, tuple], list[mx.array]],
                 clock: Phases, timeline: list[dict[str, Any]] | None) -> list[mx.array]:
    """Read the parameters that are file tensors as stored (`plan`: `_mapped`'s) through the slots and put them in
    the model. The other parameters, to evaluate MLX's way."""
    by_id, tensors, rest = plan
    if not tensors:
        return rest
    order = sorted(tensors, key=lambda i: (str(tensors[i][0]), tensors[i][1]))  # each file front to back
    read = _Reader(clock, timeline)
    try:
        loaded = [(key, a) for i in order for a in [read(*tensors[i])] for key in by_id[i]]
    finally:
        read.close()
    model.load_weights(loaded, strict=False)
    return rest


def _bare_load(a: mx.array) -> bool:
    """Whether `a` is still nothing but mx.load's read of its file tensor: an in-place operator of a `sanitize`
    (`w *= scale`: falcon_h1's multipliers) keeps the Python object and puts another graph behind it. Read from
    MLX's graph export (a few microseconds); a graph it does not recognize as one Load is evaluated MLX's way."""
    return _primitives(a) == ["Load"]


def _primitives(a: mx.array) -> list[str]:
    """The primitives of the graph behind `a`, from MLX's graph export (none once it is evaluated)."""
    graph = io.StringIO()
    mx.export_to_dot(graph, a)
    return re.findall(r'label ="([^"]*)"', graph.getvalue())


class _Reader:
    """Two staging slots and the open file: a tensor's bytes read into a slot (the GIL let go), copied by the
    GPU into a new array (queued, not waited for: the other slot takes the next chunk meanwhile)."""

    def __init__(self, clock: Phases, timeline: list[dict[str, Any]] | None) -> None:
        self.clock, self.timeline = clock, timeline
        self.pending: list[mx.array | None] = [None, None]  # each slot's copy not yet waited for
        self.turn = 0
        self.outs: list[mx.array] = []  # every tensor read, evaluated by `close`
        self.file: Any = None
        self.path: Path | None = None
        # (a slot is kept alive here while its copies run: the copy's output never takes the slot's memory over)
        self.slots: list[tuple[mx.array, Any, Callable[[], None]]] = []
        try:
            for _ in range(2):
                self.slots.append(devplanes.staging((SLOT_BYTES,)))
        except BaseException:
            self._release()
            raise

    def __call__(self, path: Path, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> mx.array:
        if path != self.path:
            if self.file is not None:
                self.file.close()
            self.file, self.path = open(path, "rb", buffering=0), path
        if nbytes == 0:
            return mx.zeros(shape, dtype)
        _, unit = next(u for u in _UNITS if nbytes % u[0] == 0)
        parts = []
        for at in range(0, nbytes, SLOT_BYTES):
            n = min(SLOT_BYTES, nbytes - at)
            parts.append(self._chunk(offset + at, n, unit))
        out = (parts[0] if len(parts) == 1 else mx.concatenate(parts)).view(dtype).reshape(shape)
        mx.async_eval(out)  # a large tensor's join queued now: its chunks freed as it runs, not at a first forward
        self.outs.append(out)
        return out

    def _chunk(self, offset: int, n: int, unit: Any) -> mx.array:
        began = time.perf_counter()
        slot, view, _ = self.slots[self.turn]
        if self.pending[self.turn] is not None:
            mx.eval(self.pending[self.turn])  # the slot's last copy done before the slot is written again
        self.file.seek(offset)
        got, into = 0, memoryview(view)[:n]
        while got < n:
            k = self.file.readinto(into[got:])
            if not k:
                raise OSError(f"{self.path}: {n - got} bytes short at offset {offset + got} (the file was cut?)")
            got += k
        out = slot[:n].view(unit) | 0  # the GPU's copy of the slot into the tensor's own memory
        mx.async_eval(out)
        self.pending[self.turn] = out
        self.turn ^= 1
        if self.timeline is not None:
            self.timeline.append({"at_ms": self.clock.elapsed_ms(began),
                                  "ms": round((time.perf_counter() - began) * 1000, 2), "bytes": n, "read": "mapped"})
        return out

    def close(self) -> None:
        try:
            mx.eval(self.outs, [p for p in self.pending if p is not None])  # every copy done before the slots go
        finally:  # (a failed wait too: the slots' memory must not go back to MLX still mapped to the host)
            self._release()

    def _release(self) -> None:
        for _, _, release in self.slots:
            release()
        self.slots.clear()
        if self.file is not None:
            self.file.close()
            self.file = None


def pieces(arrays: list[mx.array], most: int = PIECE_BYTES) -> Iterator[list[mx.array]]:
    """`arrays` in order, grouped while a group's bytes stay within `most` (one larger array: a group alone)."""
    group: list[mx.array] = []
    size = 0
    for a in arrays:
        if group and size + a.nbytes > most:
            yield group
            group, size = [], 0
        group.append(a)
        size += a.nbytes
    if group:
        yield group
