"""The Trainer's NaN / inf filter of the logged loss run on the device (``apply(device_nan_filter=True)``).

transformers' Trainer checks each micro-batch's loss before adding it to the running loss it logs
(``logging_nan_inf_filter``, on by default): ``torch.isnan(loss) or torch.isinf(loss)`` in a Python ``if``
reads the loss on the host, so the host waits there for the micro-batch's backward, and the device then idles
while the host runs the Trainer's loop, TRL's input slicing and the next forward's first launches. On the
benchmarks' 1.5B GRPO step (H100, ``speed=True``, eight micro-batches of 128) the check cost 0.15 s of a 10.1 s
step (``docs/performance.md``).

With the option, ``training_step``'s loss is filtered on the device (``torch.where``: a NaN or inf loss becomes
what the Trainer would add in its place, the running loss over one plus the steps since the last log) and handed
back as a tensor whose ``isnan`` / ``isinf`` the host answers without reading it (``False``: the value is already
filtered); the Trainer then adds it as it adds a finite loss. The running loss, so every logged ``loss``, is the
same number as without the option. Taken during ``train()`` where the Trainer keeps its running loss on itself
(``_tr_loss``, transformers >= 5.3), the filter is on, not under XLA (which skips the check), and the loss is one
value on the running loss's device; everywhere else, and in the vendored trainer, which has no such check, the
loss is returned as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["FilteredLoss", "enable_device_nan_filter"]

_CHECKS = frozenset({torch.isnan, torch.isinf, torch.Tensor.isnan, torch.Tensor.isinf})


class FilteredLoss(torch.Tensor):
    """A micro-batch loss the device filter has already replaced where it was NaN or inf: ``isnan`` / ``isinf``
    are answered on the host (``False``, on the CPU) instead of reading it; every other operation sees a plain
    tensor and returns plain tensors."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _CHECKS:
            return torch.zeros((), dtype=torch.bool)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@functools.cache
def _xla() -> bool:
    from transformers.utils import is_torch_xla_available

    return bool(is_torch_xla_available())


def filtered(trainer: Any, loss: Any) -> Any:
    """``loss`` as the Trainer's filter would add it, computed on the device, as a :class:`FilteredLoss`; the
    ``loss`` itself where the filter does not apply (see the module docstring)."""
    running = getattr(trainer, "_tr_loss", None)
    if not (isinstance(loss, torch.Tensor) and isinstance(running, torch.Tensor) and loss.numel() == 1
            and loss.device == running.device and trainer.args.logging_nan_inf_filter and not _xla()):
        return loss
    since = 1 + trainer.state.global_step - trainer._globalstep_last_logged
    return torch.where(torch.isfinite(loss), loss, running / since).as_subclass(FilteredLoss)


def enable_device_nan_filter(trainer: Any) -> None:
    """Filter ``trainer``'s micro-batch losses on the device while its ``train()`` runs (a transformers
    ``Trainer``, TRL's); a trainer without ``training_step`` (the vendored one) is left alone."""
    if not hasattr(trainer, "training_step"):
        return
    step, train = trainer.training_step, trainer.train
    training = [0]  # calls of train() in progress: the filter applies inside them only

    @functools.wraps(step)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        loss = step(*args, **kwargs)
        return filtered(trainer, loss) if training[0] else loss

    @functools.wraps(train)
    def train_filtering(*args: Any, **kwargs: Any) -> Any:
        training[0] += 1
        try:
            return train(*args, **kwargs)
        finally:
            training[0] -= 1

    trainer.training_step = training_step
    trainer.train = train_filtering
