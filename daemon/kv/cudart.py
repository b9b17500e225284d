"""Advice to CUDA's unified memory for a wake's staging ring (ctypes on the CUDA runtime MLX loaded).

MLX on CUDA keeps host-visible arrays in managed memory, which migrates page by
page to whichever processor touched it last. A staging slot is written by the
CPU (the decoders) and read once by the GPU (the join), span after span: left
alone, its pages move to the GPU at the join and back at the next fill, both on
page faults. `map_to_device` pins the slot's preferred location to the host and
maps it into the GPU's page tables, so the CPU writes host memory and the GPU
reads it over the bus without migrating anything; `unmap` undoes that before
MLX may hand the memory to a kernel's output.

Everything here is best effort: no CUDA in the process (the CPU backend,
Metal), a runtime or driver without the call, or a refusal returns False and
the ring works as before.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

__all__ = ["active", "map_to_device", "on_cuda", "unmap"]

log = logging.getLogger("kvwake.cudart")

# cudaMemoryAdvise and cudaMemLocationType (CUDA 12 and 13 runtime headers).
_SET_PREFERRED, _UNSET_PREFERRED, _SET_ACCESSED_BY, _UNSET_ACCESSED_BY = 3, 4, 5, 6
_LOC_DEVICE, _LOC_HOST = 1, 2
_CPU_DEVICE_ID = -1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_lock = threading.Lock()
_advise: object = None  # None: not looked up yet; False: unavailable; else a callable(ptr, n, advice, loc_type, id)


def _mapped(name: str) -> list[str]:
    """Paths of the shared libraries named `name` the process has mapped."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if name in line.rsplit("/", 1)[-1]})
    except OSError:
        return []


def _lookup() -> object:
    """cudaMemAdvise from a shared CUDA runtime, else cuMemAdvise_v2 from the driver (MLX's wheels link
    the runtime statically); only libraries already mapped: never loads a second CUDA."""
    for path in _mapped("libcudart.so"):
        try:
            lib = ctypes.CDLL(path)
            version = ctypes.c_int(0)
            lib.cudaRuntimeGetVersion(ctypes.byref(version))
        except (OSError, AttributeError):
            continue
        if version.value >= 13000 or hasattr(lib, "cudaMemAdvise_v2"):
            return _with_location(lib.cudaMemAdvise if version.value >= 13000 else lib.cudaMemAdvise_v2)
        fn = lib.cudaMemAdvise  # CUDA 11/12: a device ordinal, -1 for the host
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        return lambda ptr, n, advice, kind, ident: fn(ptr, n, advice, _CPU_DEVICE_ID if kind == _LOC_HOST else ident)
    for path in _mapped("libcuda.so"):
        try:
            return _with_location(ctypes.CDLL(path).cuMemAdvise_v2)  # the driver's enums match the runtime's
        except (OSError, AttributeError):
            continue
    return False


def _with_location(fn: Any) -> Any:
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Location]
    fn.restype = ctypes.c_int
    return lambda ptr, n, advice, kind, ident: fn(ptr, n, advice, _Location(kind, ident))


def _call(pairs: list[tuple[int, int, int]], ptr: int, nbytes: int) -> bool:
    global _advise
    with _lock:
        if _advise is None:
            _advise = _lookup()
    if not _advise:
        return False
    for advice, kind, ident in pairs:
        err = _advise(ptr, nbytes, advice, kind, ident)
        if err:
            log.debug("cudaMemAdvise refused", extra={"advice": advice, "error": err})
            return False
    return True


def on_cuda() -> bool:
    """MLX runs on CUDA here (its default device the GPU, and its CUDA backend there)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def active() -> bool:
    """True once a map_to_device call found the advice call (so staging here is mapped)."""
    return bool(_advise)


def map_to_device(ptr: int, nbytes: int, device: int = 0) -> bool:
    """Keep [ptr, ptr + nbytes) (managed memory) on the host, mapped for `device` to read in place.
    All or nothing: if the second advice is refused, the first is undone."""
    if not _call([(_SET_PREFERRED, _LOC_HOST, 0)], ptr, nbytes):
        return False
    if _call([(_SET_ACCESSED_BY, _LOC_DEVICE, device)], ptr, nbytes):
        return True
    _call([(_UNSET_PREFERRED, _LOC_HOST, 0)], ptr, nbytes)
    return False


def unmap(ptr: int, nbytes: int, device: int = 0) -> bool:
    """Undo map_to_device: the memory migrates on use again, as MLX expects of its buffers. Both
    advices are undone even if one is refused (logged: the memory then stays slow for the GPU to write)."""
    ok = [_call([advice], ptr, nbytes) for advice in ((_UNSET_ACCESSED_BY, _LOC_DEVICE, device),
                                                      (_UNSET_PREFERRED, _LOC_HOST, 0))]
    if not all(ok) and _advise:
        log.warning("cudaMemAdvise could not undo a staging mapping", extra={"bytes": nbytes})
    return all(ok)
