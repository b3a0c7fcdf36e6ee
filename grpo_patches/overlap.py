"""The host queues the next micro-batch while the device runs this one (``apply(overlap_micro_batches=True)``).

Two host reads of device values stand between a micro-batch's backward and the next micro-batch's forward in
a transformers ``Trainer`` (TRL's): each makes the host wait for the backward to finish, after which the device
idles while the host runs the Trainer's loop, TRL's input slicing and the forward's first launches.

- **The Trainer's NaN / inf filter of the logged loss** (``logging_nan_inf_filter``, on by default):
  ``torch.isnan(loss) or torch.isinf(loss)`` in a Python ``if``. Here ``training_step``'s loss is filtered on
  the device instead (``torch.where``: a NaN or inf loss becomes what the Trainer would add in its place, the
  running loss over one plus the steps since the last log) and handed back as a :class:`FilteredLoss`, whose
  ``isnan`` / ``isinf`` the host answers without reading it; the Trainer then adds it as a finite loss. The
  running loss, so every logged ``loss``, is the same number. Taken where the Trainer keeps its running loss on
  itself (``_tr_loss``, transformers >= 5.3), the filter is on, not under XLA (which skips the check), and the
  loss is one value on the running loss's device.
- **The causal mask's "is there padding?"**: transformers' SDPA mask (``masking_utils``) reads the padding mask
  (``padding_mask.all()``) to skip building a mask where nothing is padded (SDPA's flash kernel then runs). Here
  the answer comes from the host: when TRL's generation batch is scored, each row's "nothing padded" (its prompt
  and completion masks all ones) is read once, where TRL has just read the rewards back, and rides in the batch
  as a CPU tensor through TRL's shuffle and split; each micro-batch takes its own off before the loss sees it.
  Inside ``training_step`` with autograd on (the training forward; sampling and scoring run without it) the skip
  test then runs on that answer, without the read; where no answer came (another TRL), the mask is built, as
  transformers does while tracing.

Both only while the trainer's ``train()`` runs. Elsewhere, on older transformers and in the vendored trainer,
which has neither read, nothing changes.

Both pieces together took ~0.11 s off the 1.5B H100 step's training and scoring (the loss filter alone did not:
the mask's read then waited instead); ``benchmarks/bench_grpo.py`` cycles the pieces step by step
(``BENCH_ALTERNATE_OVERLAP=1``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FilteredLoss", "enable_overlap", "filtered", "mark_unpadded", "mask_unread", "take_unpadded"]

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


_unread = threading.local()  # .depth: training_step calls in progress on this thread that skip the mask's read;
# .unpadded: whether the micro-batch being trained has no padding at all (None: not known)
_ROWS = "_grpo_patches_unpadded"  # the generation batch's key: per row, nothing padded (a CPU bool tensor)
_ENABLED = "_grpo_patches_overlap"  # set on a trainer whose methods enable_overlap wrapped


def mark_unpadded(batch: Any) -> Any:
    """``batch`` (TRL's scored generation batch) with, per row, whether its prompt and completion masks are all
    ones: a CPU tensor, so TRL's shuffle and split carry it to each micro-batch and reading it costs no wait."""
    if isinstance(batch, dict) and all(isinstance(batch.get(k), torch.Tensor) for k in ("prompt_mask",
                                                                                        "completion_mask")):
        batch[_ROWS] = (batch["prompt_mask"].bool().all(1) & batch["completion_mask"].bool().all(1)).cpu()
    return batch


def take_unpadded(inputs: Any) -> Any:
    """A micro-batch without :func:`mark_unpadded`'s key (a copy: TRL reuses its buffered micro-batches), its answer
    kept for this thread's training forward."""
    if isinstance(inputs, dict) and _ROWS in inputs:
        inputs = dict(inputs)
        _unread.unpadded = bool(inputs.pop(_ROWS).all())
    return inputs


@functools.cache
def _masking_utils() -> Any:
    """transformers' ``masking_utils`` where it decides the SDPA mask skip in ``_ignore_causal_mask_sdpa``."""
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    return masking_utils if callable(getattr(masking_utils, "_ignore_causal_mask_sdpa", None)) else None


def _mask_kept(original: Any) -> Any:
    @functools.wraps(original)
    def ignore_causal_mask_sdpa(*args: Any, **kwargs: Any) -> bool:
        if not (getattr(_unread, "depth", 0) and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if not getattr(_unread, "unpadded", None):
            return False  # padded, or not known: build the mask, no read (see the module docstring)
        if "padding_mask" in kwargs:  # nothing padded: transformers' own test, on no padding mask
            kwargs["padding_mask"] = None
        else:
            args = (None, *args[1:])
        return original(*args, **kwargs)

    ignore_causal_mask_sdpa.grpo_patches_original = original  # type: ignore[attr-defined]
    return ignore_causal_mask_sdpa


@contextlib.contextmanager
def mask_unread() -> Iterator[None]:
    """Inside: the training forward's SDPA mask is built without reading the padding mask (on this thread). The
    module function is swapped for the duration and put back after, so nothing outlives the step."""
    module = _masking_utils()
    if module is None:
        yield
        return
    original = module._ignore_causal_mask_sdpa
    swapped = not hasattr(original, "grpo_patches_original")
    if swapped:
        module._ignore_causal_mask_sdpa = _mask_kept(original)
    _unread.depth = getattr(_unread, "depth", 0) + 1
    try:
        yield
    finally:
        _unread.depth -= 1
        if swapped:
            module._ignore_causal_mask_sdpa = original


def _after(method: Any, then: Any, training: list[int]) -> Any:
    """``method``, its result passed through ``then`` while ``train()`` runs."""
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        return then(out) if training[0] else out

    return wrapped


def enable_overlap(trainer: Any) -> None:
    """Take both host reads out of ``trainer``'s micro-batches while its ``train()`` runs (a transformers
    ``Trainer``, TRL's), once per trainer; a trainer without ``training_step`` (the vendored one) is left alone."""
    if not hasattr(trainer, "training_step") or getattr(trainer, _ENABLED, False):
        return
    setattr(trainer, _ENABLED, True)
    step, train = trainer.training_step, trainer.train
    training = [0]  # calls of train() in progress: both apply inside them only

    @functools.wraps(step)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        if not training[0]:
            return step(*args, **kwargs)
        _unread.unpadded = None
        try:
            with mask_unread():
                loss = step(*args, **kwargs)
        finally:
            _unread.unpadded = None
        return filtered(trainer, loss)

    for name, wrap in (("_generate_and_score_completions", mark_unpadded), ("_prepare_inputs", take_unpadded)):
        method = getattr(trainer, name, None)  # TRL's; the vendored trainer has neither
        if method is not None:
            setattr(trainer, name, _after(method, wrap, training))

    @functools.wraps(train)
    def train_overlapping(*args: Any, **kwargs: Any) -> Any:
        training[0] += 1
        try:
            return train(*args, **kwargs)
        finally:
            training[0] -= 1

    trainer.training_step = training_step
    trainer.train = train_overlapping
