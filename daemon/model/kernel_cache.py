"""MLX's CUDA kernels, compiled once per machine and not on a request's path.

MLX on CUDA compiles many of its kernels at their first use in a process (NVRTC): the gathers a batch's
compaction runs (`BatchKVCache.filter`), the fused elementwise ops of a forward pass, each a compile of
seconds. It keeps what it compiled in a disk cache (`MLX_PTX_CACHE_DIR`: `serve` puts it in the user's cache
folder, daemon/serve.py), so a compile happens once per machine, not once per process. On a machine whose
cache lacks them, the compiles a first start and a first round would wait for (a compaction's gathers once
stalled a decode step for seconds mid-round) run in a child process here (`Warmer`), on the model's
miniature (same kind of model, same dtype, the smallest widths), while the engine loads the weights; the
engine waits for it before its first forward pass, whose kernels then come from the cache. A paged engine's
warmers run the miniature over a pool of pages too (its writes, gathers and copies are kernels of their own). A
process of its own, because MLX evaluates on the thread that holds its stream: a thread beside the load could not
compile for it; one a part (two, three with pages), each importing as `serve` does (no PyTorch). A part whose
warmer filled the cache is noted there (`NOTES_DIR`), and no later start on the machine runs it again.

Custom kernels (`mx.fast.cuda_kernel`, model/ragged_decode.py, model/quantized_kernel.py) are compiled in every
process: MLX keeps them out of its disk cache. The row kernel and a 4-bit model's kernel, seconds of NVRTC, are
compiled on a thread beside the load
instead (`BesideLoad`, which makes a wake's staging ring too): MLX keeps a custom kernel for the process
whichever thread's stream compiled it, and the compile releases the GIL. CUDA only: on the CPU and Metal
nothing here runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvwake import __version__
from kvwake.daemon.model import path_costs

__all__ = ["PARTS", "PATHS_PART", "BesideLoad", "Warmer", "keep_compiled_kernels", "miniature", "padded_chunk",
           "paged_wanted", "safetensors_header", "start_early", "text_config", "weights_dtype"]

log = logging.getLogger("kvwake.kernels")
WAIT_S = 120.0  # a warmer still compiling then is left to finish alone (the engine compiles what it needs)
PARTS = ("forward", "compaction")
# a paged engine's (kv/paged_cache.py) too: its pool's writes and gathers are kernels of their own, compiled at a
# paged daemon's first turns where no warmer ran them (a loaded GPU's first chats waited seconds for them)
PAGED_PART = "paged"
# With `paths_ahead`: the attention paths' costs (model/attention.py `PathCosts`) measured in a child beside the load
# where the machine's costs file lacks them, not in the warm-up's idle moments, which agents' turns may never leave
# (docs/decisions.md, "The attention paths' costs measured before serving")
PATHS_PART = "paths"
# (A quantized model's products compile nothing: model/quantized.py dequantizes where MLX would compile)


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (its tensors by name, "__metadata__" left out) and where its data begins (read
    here, where the warmer's early start imports nothing heavy; model/weights.py reads the tensors by it)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def weights_dtype(model_path: Path) -> str:
    """The dtype name ("bfloat16", "float16", "float32") of the model's norm weights, read from the first
    safetensors file's header: what its activations and KV are computed in (a quantized model's too)."""
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        header, _ = safetensors_header(path)
        kinds = [v["dtype"] for k, v in header.items() if "norm" in k]
        if kinds:
            return names.get(kinds[0], "float32")
    return "bfloat16"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the model that runs the text: `config`, or a multimodal wrapper's `text_config` (Gemma 3's
    4B, 12B and 27B checkpoints), with the wrapper's vocabulary where it names none."""
    inner = config.get("text_config")
    return {"vocab_size": config.get("vocab_size"), **inner} if isinstance(inner, dict) else config


def miniature(config: dict[str, Any]) -> dict[str, Any]:
    """The model's config at its smallest widths: two query heads over one KV head of the same head size, a
    small MLP and vocabulary; its layers as many and of the same kinds (hybrid models list them). Its kernels
    are the model's (MLX names a compiled kernel by its ops, dtypes and constants, not by its sizes)."""
    if isinstance(config.get("text_config"), dict):  # a wrapper: its text model made small, the rest as it is
        return {**config, "text_config": miniature(text_config(config)), "vocab_size": 256}
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    hidden = 2 * head_dim
    # widths named otherwise by some kinds (lfm2's block_dim) are the hidden size's value; MLP widths by name
    small = {k: hidden if v == config["hidden_size"] and isinstance(v, int) else
             128 if "intermediate" in k or "ff_dim" in k else v for k, v in config.items()}
    return {**small, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": hidden,
            "head_dim": head_dim, "vocab_size": 256, "tie_word_embeddings": True}


def _paths_missing(path: Path) -> bool:
    """Whether the costs file lacks a row the model in `path` wants (its attention shape from its config, at its
    context's ladder); False where the config or the weights' header does not give the shape (the engine
    measures, or goes without)."""
    import mlx.core as mx

    config = model_config(path)
    shape = path_costs.attention_shape(config.get)
    if shape is None:
        return False
    try:
        dtype = getattr(mx, weights_dtype(path))
    except (OSError, ValueError, KeyError):
        return False
    rows = path_costs.stored_costs(path_costs.costs_key(*shape, dtype, path_costs.PROBE_QUERIES,
                                                        path_costs.PROBE_REPEATS))
    return any(k not in rows for k in path_costs.key_ladder(config.get("max_position_embeddings")))


def keep_compiled_kernels() -> None:
    """Keep the kernels MLX compiles on CUDA (NVRTC, at a kernel's first use) in the user's cache folder,
    unless MLX_PTX_CACHE_DIR says where: MLX's default is the temporary folder, which a reboot empties,
    and the first start after one compiled them all again, a slow first forward pass (docs/decisions.md,
    "Daemon"). Shared by every daemon of the user, as MLX's default is; one
    folder per MLX version (the cache is keyed by kernel name only). Set before the first kernel is
    compiled (MLX reads it once) and before a warmer starts (it inherits it); nothing uses it off CUDA."""
    import mlx.core as mx

    from kvwake.paths import default_cache_dir

    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(default_cache_dir() / f"mlx-{mx.__version__}" / "ptx"))


# Warmers started before their engine was made (`start_early`), by model folder
_early: dict[Path, Warmer] = {}
# Model folders whose warmers ended with the cache filled in this process: the process has loaded those kernels
# too, so a model loaded again (an unload, then a turn for its sessions) starts none. Two processes importing MLX
# and running the miniature on the GPU can outlast a reload's weights, now read in seconds, and the new engine
# thread's first job waits for them, with the turn's wake behind it (docs/decisions.md, "Several models"). By the
# parts that ran: an engine of the folder that keeps its KV in pages (a bench's second) wants the paged part too
_done: dict[tuple[Path, str, str], set[str]] = {}  # (folder, its config's digest, its weights' dtype): `_warmed_key`


def _warmed_key(path: Path) -> tuple[Path, str, str]:
    """What a folder's warmers compiled for: the folder, its config and its weights' dtype (a folder whose model
    changed in place is warmed again)."""
    try:
        config = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
        dtype = weights_dtype(path)
    except (OSError, ValueError, KeyError):
        config = dtype = ""
    return path, config, dtype


# The parts whose warmers filled MLX's disk cache on this machine, noted in that cache's folder (what empties the
# cache empties the notes), one empty file a part and model config: a later process starts none of them. A warmer
# on a filled cache compiled nothing that served its daemon (MLX's kernels come from the disk cache in any process),
# yet each was a child importing MLX and making a CUDA context beside a restart's wakes, and the engine's first
# forward pass waited for it where the weights were read sooner (a small model, the tests' daemons). Keyed by what
# the child runs: the config's bytes, the weights' dtype, the part, and this module and kvwake's version (a changed
# miniature compiles other kernels). A note whose kernels went missing costs their compile at first use, as without
# a warmer.
NOTES_DIR = "kvwake-warmed"


def _note(path: Path, part: str) -> Path | None:
    """Where the note of `part` for the model in folder `path` lives; None where MLX keeps no disk cache here (no
    MLX_PTX_CACHE_DIR: `keep_compiled_kernels` sets it on CUDA) or the config cannot be read. The attention costs'
    part keeps its own record (the costs file)."""
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    _, config, dtype = _warmed_key(path)
    if not cache or not config or part == PATHS_PART:
        return None
    key = json.dumps([__version__, _module_digest(), config, dtype, part])
    return Path(cache) / NOTES_DIR / hashlib.sha256(key.encode()).hexdigest()[:32]


def _module_digest() -> str:
    global _digest
    if _digest is None:
        _digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return _digest


_digest: str | None = None


def _noted(path: Path, part: str) -> bool:
    note = _note(path, part)
    return note is not None and note.exists()


def _write_notes(path: Path, parts: Sequence[str]) -> None:
    """Note `parts` done for the model in `path` (a folder that cannot be written: no note, warmers next time)."""
    for part in parts:
        note = _note(path, part)
        if note is not None:
            try:
                note.parent.mkdir(parents=True, exist_ok=True)
                note.touch()
            except OSError as exc:
                log.warning("kernel warmer's note not written: %s", exc)
                return


def _missing(path: Path, paged: bool, paths: bool = False) -> tuple[str, ...]:
    """The parts a folder's engine wants (`PARTS`, with `paged` PAGED_PART, with `paths` PATHS_PART where the costs
    file lacks the model's rows) whose warmers have not filled the cache, in this process or, noted, on this
    machine (`NOTES_DIR`)."""
    done = _done.get(_warmed_key(path), set())
    wanted = PARTS + ((PAGED_PART,) if paged else ()) + ((PATHS_PART,) if paths and _paths_missing(path) else ())
    return tuple(part for part in wanted if part not in done and not _noted(path, part))


def start_early(model: str | None, kernel_warmer: bool = True, paged: bool | None = False,
                paths: bool = False) -> bool:
    """Start the warmers of `model` (the settings' model) before the daemon's heavy imports, for the engine
    to take (`Warmer.for_model`): on a fresh machine their compiles, not the weights, end a first start's
    work, and they began only once the imports were done. Only a model given as a folder, and on CUDA (this
    imports MLX's core alone). `paged`: the engine will keep its KV in pages (None: where the config names plain
    attention only, `plain_config`). Says whether it started them."""
    if not kernel_warmer or model is None or not Path(model).expanduser().is_dir():
        return False
    import mlx.core as mx

    if not (mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()):
        return False
    keep_compiled_kernels()
    path = Path(model).expanduser().resolve()
    missing = _missing(path, paged_wanted(paged, path), paths)
    if path not in _early and missing:
        _early[path] = Warmer(path, parts=missing)
    return True


class Warmer:
    """The child processes that fill MLX's kernel cache for the model (module docstring), one per part
    (`PARTS`: each part's compiles are seconds of one core on a fresh machine, so they run side by side);
    `wait` before the engine's first forward pass."""

    @classmethod
    def for_model(cls, model_path: Path, paged: bool = False, paths: bool = False) -> Warmer | None:
        """The warmers `start_early` started for this model folder, else new ones (`paged`: a paged engine's part
        too; `paths`: the attention costs' where not kept); None when this process's warmers of the folder filled
        the cache already (`_done`)."""
        path = Path(model_path).resolve()
        early = _early.pop(path, None)
        missing = _missing(path, paged, paths)
        if early is not None and (not missing or not set(missing) <= set(early.parts)):
            early.stop()  # all done here already, or started without a part this engine wants: they end alone
            early = None
        if not missing:
            return None
        return early or cls(model_path, parts=missing)

    def __init__(self, model_path: Path, paged: bool = False, parts: tuple[str, ...] | None = None) -> None:
        """Warmers for `parts` (default: `PARTS`, and PAGED_PART with `paged`)."""
        self.path = Path(model_path).resolve()
        self.started = time.perf_counter()
        self.parts = parts if parts is not None else PARTS + ((PAGED_PART,) if paged else ())
        self.procs = [self._start(part) for part in self.parts]
        # each warmer collected on a thread of its own as it ends (its stderr read, its exit status taken): a `wait`
        # only waits for their notes, and a `stop` from another thread ends it at once
        self._ended = threading.Condition()
        self._errors: dict[int, bytes] = {}  # index of a warmer that ended -> its stderr
        self.stopped = False
        self.waited = False
        for i, proc in enumerate(self.procs):
            threading.Thread(target=self._collect, args=(i, proc), name="kvwake-warmer-reaper", daemon=True).start()

    def _start(self, part: str) -> subprocess.Popen:
        """One part's warmer: this module, run in a child process on the model's miniature (`__main__`)."""
        return subprocess.Popen([sys.executable, "-m", "kvwake.daemon.model.kernel_cache", str(self.path), part],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))

    def _collect(self, i: int, proc: subprocess.Popen) -> None:
        _, err = proc.communicate()
        with self._ended:
            self._errors[i] = err or b""
            self._ended.notify_all()

    def wait(self, timeout: float = WAIT_S) -> bool:
        """Wait for the warmers (at most `timeout` from their start): whether every one finished and filled the
        cache. A `stop` from another thread meanwhile ends the wait at once (False); a warmer not waited for to
        its end ends on its own."""
        with self._ended:
            if self.waited:  # once: the engine thread's first job
                return False
            self.waited = True
            self._ended.wait_for(lambda: self.stopped or len(self._errors) == len(self.procs),
                                 timeout=max(0.0, self.started + timeout - time.perf_counter()))
            errors, stopped = dict(self._errors), self.stopped
        done = bool(self.procs) and not stopped
        for i, part in enumerate(self.parts):
            if i not in errors:
                if not stopped:
                    log.warning("kernel warmer (%s) still compiling after %.0f s: the engine goes on without it",
                                part, timeout)
                done = False
            elif self.procs[i].returncode != 0:  # the engine compiles what it needs itself, as without a warmer
                log.warning("kernel warmer (%s) exited %s: %s", part, self.procs[i].returncode,
                            errors[i].decode(errors="replace")[-600:])
                done = False
        if done:
            log.info("kernel warmers done in %.1f s", time.perf_counter() - self.started)
            _done.setdefault(_warmed_key(self.path), set()).update(self.parts)
            _write_notes(self.path, self.parts)
        return done

    def stop(self) -> None:
        """Stop waiting for the warmers, from any thread: a `wait` under way returns (a model stopped while its
        engine thread's first job waits for them), and none is waited for later. Not killed: MLX writes each
        compiled kernel into its disk cache in place, and a warmer killed inside that write would leave it broken
        for every later process, while one left to finish only compiles for a few seconds more (each is reaped
        as it ends)."""
        with self._ended:
            self.stopped = True
            self._ended.notify_all()


# Config keys that name layers other than plain attention (a sliding window, recurrent blocks): such a model's
# wake stages only its plain layers, in rings of another shape than the config's layer count gives
NOT_PLAIN = ("sliding_window", "layer_types", "layers_block_type", "full_attn_idxs", "hybrid_override_pattern",
             "block_types", "attn_layer_indices")


def model_config(model_path: Path) -> dict[str, Any]:
    """The text model's config in `model_path` (`text_config`); {} where there is none to read."""
    try:
        return text_config(json.loads((Path(model_path) / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def plain_config(config: dict[str, Any]) -> bool:
    """Whether a (text) config names only plain attention layers: no sliding windows (a `sliding_window` that
    `use_sliding_window: false` turns off, as Qwen's configs do, is none; `layer_types` all full attention is
    plain) and no recurrent or hybrid layers. A guess before the load (the loaded model's cache decides)."""
    if any(config.get(k) for k in NOT_PLAIN if k not in ("sliding_window", "layer_types")):
        return False
    if any(kind not in ("full_attention", "attention") for kind in config.get("layer_types") or ()):
        return False
    return not config.get("sliding_window") or config.get("use_sliding_window") is False


def paged_wanted(configured: bool | None, model_path: Path) -> bool:
    """Whether an engine of `model_path` keeps its plain KV in pages (tuning paged_kv): `configured` when given,
    else on CUDA for a model whose config names plain attention layers only (`plain_config`). There a fleet over a
    shared prompt holds it once and decodes as fast; on the CPU each step would gather every row's pages, and
    Metal has no paged kernel (docs/decisions.md, "The paged default")."""
    if configured is not None:
        return configured
    from kvwake.daemon.kv import cudart

    return cudart.on_cuda() and plain_config(model_config(model_path))


# Row kernel shapes built in this process (`BesideLoad`): shape -> whether the kernel takes it
_rows: dict[tuple[int, int, int, Any], bool] = {}
_rows_lock = threading.Lock()
_paged: set[tuple[tuple[int, int, int, Any], int]] = set()  # (shape, page tokens) whose paged kernel was built


class BesideLoad:
    """What a thread of its own makes while the weights load, from the model's config (module docstring):
    the row kernel (model/ragged_decode.py) for the heads and dtype the config and weights name, with
    `quantized` a 4-bit model's kernel (model/quantized_kernel.py), and, given
    `staging_tokens` (the store's block), a wake's staging ring kept for the first wake (kv/devplanes.py:
    pinned host memory, a few hundred ms a restart's first wake would wait for). `result` after the load:
    the shape the kernel was built for, which the engine compares with the loaded model's (a config that
    names its heads otherwise: the engine builds the kernel itself, as without this).

    `others`: the folders of other models this daemon may load later, whose row kernels are built here too
    (each shape once). MLX compiles a custom kernel holding a process-wide lock that every kernel launch's
    lookup takes as well, so a second model's compile at its load stalls the first model's decoding for the
    whole compile (docs/benchmarks.md, "Several models"); at the first start nothing decodes yet."""

    def __init__(self, model_path: Path, row_kernel: bool, staging_tokens: int | None,
                 others: Sequence[Path] = (), wakes: Callable[[], int] | None = None, quantized: bool = False,
                 page_tokens: int | None = None) -> None:
        self.shape: tuple[int, int, int, Any] | None = None
        # with `page_tokens` (a paged engine's pages), the paged kernel and the page copy for the model's shape too:
        # MLX compiles a custom kernel in every process, and built after the load they held up a paged daemon's
        # start (docs/benchmarks.md, "Paged KV in the fleet, again"); `paged` the (shape, page tokens) built, which
        # the engine compares with its own
        self.page_tokens, self.paged = page_tokens, None
        self.built: list[tuple[int, int, int, Any]] = []  # every shape built, the model's first
        self.wakes = wakes  # how many sessions will wake at once after the start (a slot each: devplanes.warm)
        self.quantized = quantized  # a 4-bit model's kernel too (model/quantized_kernel.py)
        self.quantized_built = False  # and whether it was built (the engine takes it only then)
        self.ran = False  # whether its thread ran anything on MLX (made a stream of its own, to let go of at the end)
        self.thread = threading.Thread(target=self._build, name="kvwake-beside-load", daemon=True,
                                       args=(Path(model_path), row_kernel, staging_tokens, list(others)))
        self.thread.start()

    def _build(self, model_path: Path, row_kernel: bool, staging_tokens: int | None, others: list[Path]) -> None:
        import mlx.core as mx

        from kvwake.daemon.kv import devplanes

        try:
            config = json.loads((model_path / "config.json").read_text())
            shape = _heads(model_path, config)
            if row_kernel and self._build_row(shape):
                self.shape = shape
                if self.page_tokens:
                    self._build_paged(shape, self.page_tokens)
            config = text_config(config)
            if staging_tokens and plain_config(config):
                self.ran = True
                kv = mx.zeros((1, shape[1], 1, shape[2]), shape[3])
                devplanes.warm(kv, 2 * config["num_hidden_layers"], staging_tokens,
                               wakes=self.wakes() if self.wakes is not None else 0)
            for other in others if row_kernel else ():
                with contextlib.suppress(OSError, ValueError, KeyError):  # not a local model folder of the kind
                    self._build_row(_heads(other, json.loads((other / "config.json").read_text())))
        except Exception as exc:  # only the start's speed is at stake: the engine builds it itself
            log.warning("row kernel or staging not made beside the load: %r", exc)
        try:  # last, apart: the engine takes the 4-bit kernel only where it was built here
            quantization = json.loads((model_path / "config.json").read_text()).get("quantization") or {}
            if self.quantized and quantization.get("bits") == 4 and quantization.get("mode", "affine") == "affine":
                from kvwake.daemon.model import quantized_kernel

                self.ran = True
                self.quantized_built = quantized_kernel.build(getattr(mx, weights_dtype(model_path)))
        except Exception as exc:  # a GPU without the tensor cores' bf16 products (before sm_80), say
            log.warning("the 4-bit kernel was not built, a quantized model's products stay MLX's: %r", exc)
        finally:
            if self.ran:  # a later load whose kernels were all built makes no stream here (one made and let go of
                # at once beside another model's decoding cost that model's steps: docs/benchmarks.md, "Several
                # models")
                mx.synchronize()
                mx.clear_streams()  # this thread's stream, let go by the thread that made it (model/loader.py)

    def _build_row(self, shape: tuple[int, int, int, Any]) -> bool:
        """The row kernel for `shape`, unless built already in this process (MLX keeps a custom kernel for the
        process, whichever thread built it); whether the kernel takes the shape."""
        from kvwake.daemon.model import ragged_decode

        with _rows_lock:
            known = _rows.get(shape)
        if known is not None:
            if known and shape not in self.built:
                self.built.append(shape)
            return known
        self.ran = True  # before the build: one that raises has made this thread's stream too
        ok = bool(ragged_decode.build(*shape))
        with _rows_lock:
            _rows[shape] = ok
        if ok:
            self.built.append(shape)
        return ok

    def _build_paged(self, shape: tuple[int, int, int, Any], page_tokens: int) -> None:
        """The paged kernel and the page copy for `shape` and pages of `page_tokens`, once a process."""
        from kvwake.daemon.model import ragged_decode

        with _rows_lock:
            known = (shape, page_tokens) in _paged
        if not known:
            self.ran = True
            ragged_decode.build(*shape, page_tokens=page_tokens, row=False)
            with _rows_lock:
                _paged.add((shape, page_tokens))
        self.paged = (shape, page_tokens)

    def result(self) -> tuple[int, int, int, Any] | None:
        self.thread.join()
        return self.shape


def _heads(model_path: Path, config: dict[str, Any]) -> tuple[int, int, int, Any]:
    """(query heads, KV heads, head size, dtype) as `config` and the weights name them: what the row kernel is
    built for (ragged_decode.shape_of gives the same from a loaded model)."""
    import mlx.core as mx

    config = text_config(config)
    heads = config["num_attention_heads"]
    return (heads, config.get("num_key_value_heads") or heads,
            config.get("head_dim") or config["hidden_size"] // heads, getattr(mx, weights_dtype(model_path)))


def padded_chunk(dtype: Any, head_dim: int, key: Any) -> tuple[Any, Any]:
    """A pack's turn chunk at a padded shape (model/attention.py `padded_attention`: its keys padded, its
    additive mask, the masked fused kernel) on two query heads over one KV head, random by `key`, and the same
    chunk at its own shape: (padded, own). The miniature's prefill never takes that path, and on a machine
    whose cache lacked its kernels a fleet's first pack of turns at two shapes compiled them mid-round
    (docs/benchmarks.md, "fleet")."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from kvwake.daemon.model import attention

    n = attention.PLAIN_MAX_QUERIES + 1  # the shortest chunk that path takes
    q, k, v = (mx.random.normal((1, heads, length, head_dim), key=part).astype(dtype) for heads, length, part in
               zip((2, 1, 1), (n, n + 8, n + 8), mx.random.split(key, 3)))
    scale = head_dim ** -0.5
    padded = attention.padded_attention(scaled_dot_product_attention)(q, k, v, None, scale=scale, mask="causal")
    return padded, scaled_dot_product_attention(q, k, v, None, scale=scale, mask="causal")


def _warm(model_path: Path, part: str) -> None:
    """A child's work: the miniature's prefill and decode step and a padded chunk ("forward"), the same over a
    pool of pages ("paged"), a batch's compaction, or the attention paths' costs at the model's shape ("paths")."""
    from kvwake.daemon.imports import lighten_imports

    lighten_imports()  # as `serve` does: frameworks mlx-lm's imports would pull in stay out
    import mlx.core as mx

    dtype = getattr(mx, weights_dtype(model_path))
    if part == PATHS_PART:  # the model's own attention shape (random tensors: no weights), not the miniature's
        from kvwake.daemon.model import attention

        config = model_config(model_path)
        attention.measure_ahead(config, dtype, config.get("max_position_embeddings"))
        return
    config = miniature(json.loads((Path(model_path) / "config.json").read_text()))
    if part in ("forward", PAGED_PART):  # the miniature itself
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config=config)
        model = model_class(args_class.from_dict(config))
        model.set_dtype(dtype)
    if part == "forward":
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        mx.eval(model(mx.arange(16, dtype=mx.uint32)[None], cache=cache))  # past a sliding window of 8 too
        mx.eval(model(mx.array([[1]], dtype=mx.uint32), cache=cache))
        from kvwake.daemon.model.packing import packable_model

        if packable_model(model):  # only a pack's rows pad (scheduler/prefill.py `_pack_chunk`)
            mx.eval(padded_chunk(dtype, text_config(config)["head_dim"], mx.random.key(0)))
        return
    if part == PAGED_PART:  # as a paged engine prefills and decodes (kv/paging.py `Pages`): pages of 16 tokens
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        from kvwake.daemon.kv import cache_blocks, paged_cache
        from kvwake.daemon.kv.pages import PagePool

        blank = make_prompt_cache(model)
        if not any(type(c) is KVCache for c in blank):  # nothing a paged engine would page
            return
        pool = PagePool(paged_cache.page_layout(blank, cache_blocks.layout(blank, model=model), 16, 16), 8)
        cache = paged_cache.paged_cache(pool, blank)
        # a page and a half, its pages one run: the writes of a run of slots, the reads of a slice
        mx.eval(model(mx.arange(24, dtype=mx.uint32)[None], cache=cache), paged_cache.state_arrays(cache))
        if all(isinstance(c, paged_cache.PagedKVCache) for c in cache):
            # a fork's first write into the partial page it shares: the page copied (a gather by slot); its table
            # then no run, its reads gather by token
            twin = paged_cache.fork(cache, 20)
            mx.eval(model(mx.array([[1, 2]], dtype=mx.uint32), cache=twin), paged_cache.state_arrays(twin))
        layout = pool.layout  # a batch's step writes a slot a row: one scatter along the slots
        kv = mx.zeros((layout.kv_heads, 2, layout.head_dim), layout.dtype)
        pool.write(0, mx.array([0, 17], mx.int32), kv, kv)
        mx.eval(pool.keys[0], pool.values[0])
        return
    from mlx_lm.models.cache import BatchKVCache

    # A batch's compaction (model/decoder.py `_compact`): rows taken by index from its KV, offsets and tokens
    batch = BatchKVCache([0, 0, 0])
    kv = mx.zeros((3, 1, 8, text_config(config)["head_dim"]), dtype)
    batch.update_and_fetch(kv, kv)
    batch.filter([0, 2])
    tokens = mx.zeros((3,), mx.uint32)[[0, 2]]
    mx.eval(batch.keys, batch.values, batch.offset, batch.left_padding, tokens)


if __name__ == "__main__":
    _warm(Path(sys.argv[1]), sys.argv[2])
