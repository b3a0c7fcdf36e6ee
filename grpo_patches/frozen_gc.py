"""Python's cyclic collector kept off what a run's first step built (``apply(freeze_gc=True)``).

After its first step a compiled run holds many long-lived Python objects (dynamo's and inductor's graphs,
guards and generated code, the captures' bookkeeping, the reward models' compiled layers), and every full
(generation 2) collection walks them all: on the benchmarks' 1.5B GRPO step (H100, ``speed=True``) one
took 0.67-1.14 s, every three to five 10.5 s steps. Frozen after the first step (``gc.freeze()``, as
vLLM freezes after its CUDA-graph captures), the collector left them alone: 0.06-0.11 s a step for all of
its collections, full ones included.

The freeze comes once, after the first optimizer step: a full collection first (so what is garbage then is
freed, not frozen), then ``gc.freeze()``. When ``train()`` returns or raises, ``gc.unfreeze()`` hands the
objects back to the collector, unless the process had frozen objects of its own before the step
(``gc.freeze()`` has no partial undo: those stay frozen, as their owner left them). What differs from stock:
objects alive at the freeze that later end up in reference cycles are freed at the end of training instead
of at a full collection, so a run can hold at most what its first step held a while longer.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

__all__ = ["enable_frozen_gc"]


class _Freeze:
    """One trainer's freeze: after its first step, undone at the end of its training."""

    def __init__(self) -> None:
        self.frozen = False  # by this object, since the last end of training
        self.owned = False  # the process had nothing frozen before, so ours may be undone

    def step_done(self) -> None:
        if self.frozen:
            return
        self.owned = gc.get_freeze_count() == 0
        gc.collect()
        gc.freeze()
        self.frozen = True

    def train_done(self) -> None:
        if self.frozen and self.owned:
            gc.unfreeze()
        self.frozen = False


def _callback(freeze: _Freeze) -> Any:
    from transformers import TrainerCallback

    class FreezeGC(TrainerCallback):
        """``apply(freeze_gc=True)``'s callback: the freeze after the first optimizer step."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            freeze.step_done()

    return FreezeGC()


def enable_frozen_gc(trainer: Any) -> None:
    """Freeze the collector after ``trainer``'s first optimizer step (a callback of a transformers ``Trainer``,
    TRL's; after the vendored trainer's first ``optimize``) and unfreeze it when its ``train()`` returns or
    raises. A loop of the vendored trainer's ``step()`` calls stays frozen until the process ends or calls
    ``gc.unfreeze()``."""
    freeze = _Freeze()
    if hasattr(trainer, "add_callback"):
        trainer.add_callback(_callback(freeze))
    else:
        optimize = trainer.optimize

        def optimize_then_freeze(*args: Any, **kwargs: Any) -> Any:
            out = optimize(*args, **kwargs)
            freeze.step_done()
            return out

        trainer.optimize = optimize_then_freeze
    train = trainer.train

    @functools.wraps(train)
    def train_then_unfreeze(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        finally:
            freeze.train_done()

    trainer.train = train_then_unfreeze
