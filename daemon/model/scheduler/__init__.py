"""The scheduler: what every session feeds the model, step by step.

steps.py decides each turn of the engine thread (quick jobs, one job or pack,
a decode step); prefill.py how a session's prompt is cut into chunks, packs and
slices (slices.py); the decoder (model/decoder.py) admits calls into its batch.
The engine (model/engine.py) executes what these decide.
"""

from kvwake.daemon.model.scheduler.prefill import PrefillPlanner, default_step, pack_groups
from kvwake.daemon.model.scheduler.steps import Scheduler, Step

__all__ = ["PrefillPlanner", "Scheduler", "Step", "default_step", "pack_groups"]
