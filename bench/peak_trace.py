"""A pytest plugin (a probe, not a test): prints each call in the wake and restore modules that raised MLX's peak
by more than 1 MiB, with the active bytes before and after it, so a wake's peak is traced to the call that made it
(nested calls print each, innermost first). Session 52 found test_paged_wakes' staged peak on CUDA with it:

    PYTHONPATH=bench:$PYTHONPATH python -m pytest -p no:xdist -s -p peak_trace tests/test_paged_wakes.py -k buffer
"""
import functools
import inspect

import mlx.core as mx

LIMIT = 1 << 20


def _wrap(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def traced(*a, **k):
        before, active = mx.get_peak_memory(), mx.get_active_memory()
        try:
            return f(*a, **k)
        finally:
            peak = mx.get_peak_memory()
            if peak > before + LIMIT:
                print(f"PEAK {label}: peak +{peak - before} (to {peak}), active before {active}, "
                      f"after {mx.get_active_memory()}", flush=True)
    setattr(owner, name, traced)


def pytest_configure(config):
    from kvwake.daemon.kv import devplanes, page_restore, paging, pipeline, restore_buffers
    for mod in (devplanes, page_restore, restore_buffers, pipeline, paging):
        for name, obj in list(vars(mod).items()):
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                _wrap(mod, name, f"{mod.__name__.rsplit('.', 1)[1]}.{name}")
            elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                for m, fn in list(vars(obj).items()):
                    if inspect.isfunction(fn) and not m.startswith("__"):
                        _wrap(obj, m, f"{mod.__name__.rsplit('.', 1)[1]}.{name}.{m}")
