"""Training-health monitoring (memory, GPU use, in-group reward spread, gradient norm) as a ``transformers.TrainerCallback``, logged through ``report_to``.

Per rank: allocated / peak / free GPU memory (warn under 2 GiB free) and GPU utilization where NVML
is available (``torch.cuda.utilization``, which needs the optional ``nvidia-ml-py``; absent, the
metric is skipped, not faked). On a CPU-only run the process RSS and its peak are logged instead,
and no "free" figure (a CPU process has no device memory of its own to run out of).
Globally: in-group reward std (warn above 0.5 after 1000 steps) and gradient norm (warn above 10).

Where the numbers come from:

- in-group reward std: TRL (>= 0.16) keeps the last generation batch's per-function rewards,
  gathered over all ranks, in ``trainer._logs["rewards"]``; they are combined with
  ``trainer.reward_weights`` as TRL does, cut into consecutive groups of ``num_generations`` (TRL's
  own ``view(-1, G)``), and the std of each group is taken with Bessel's correction, like TRL's
  ``nanstd``. TRL's logged ``reward_std`` is the std over the whole batch, not within groups. The
  metric needs the trainer, so use :meth:`GRPOMonitorCallback.attach`; without it it is skipped.
- gradient norm: the ``grad_norm`` the Trainer logs (pre-clipping, the last step of each logging
  interval: set ``logging_steps=1`` to check every step).

How it reaches the loggers: the Trainer calls every callback's ``on_log`` with the same ``logs``
dict, in list order, and the ``report_to`` integrations sit right after ``DefaultFlowCallback``, so
a callback appended later would add its keys after they have written. :meth:`attach` puts this
callback first. Per-rank figures are exchanged in ``on_step_end`` (every rank reaches it after
each optimizer step), so ``on_log`` itself runs no collective and cannot hang.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["GRPOMonitorCallback", "MonitorWarning", "in_group_reward_std"]

GiB = 2**30


class MonitorWarning(RuntimeWarning):
    """A training signal past one of the monitor's thresholds (memory, reward spread, gradient norm)."""


def in_group_reward_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Std of each consecutive group of ``num_generations`` rewards (NaNs ignored, Bessel-corrected).

    A trailing partial group is dropped. Groups with fewer than two scored rewards give NaN.
    """
    n = (rewards.numel() // num_generations) * num_generations
    grouped = rewards[:n].reshape(-1, num_generations).double()
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(dim=1)
    var = torch.nansum((grouped - mean) ** 2, dim=1) / (count - 1).clamp(min=1)
    return torch.where(count > 1, var.sqrt(), torch.full_like(var, float("nan")))


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


class GRPOMonitorCallback(TrainerCallback):
    """Logs memory, GPU utilization, in-group reward std and gradient norm; warns past its thresholds.

    Use ``GRPOMonitorCallback().attach(trainer)`` (or pass it in ``callbacks=`` and call
    ``attach`` afterwards): see the module docstring for why the position matters. Metric names:
    ``monitor/rank{r}/memory_allocated_gb``, ``.../memory_peak_gb``, ``.../memory_free_gb``,
    ``.../gpu_utilization`` (CUDA) or ``.../cpu_rss_gb``, ``.../cpu_peak_rss_gb`` (CPU), and
    ``monitor/reward_group_std``, ``monitor/reward_group_std_max``.
    """

    def __init__(
        self,
        *,
        min_free_gb: float = 2.0,
        reward_std_threshold: float = 0.5,
        reward_std_after_step: int = 1000,
        grad_norm_threshold: float = 10.0,
        prefix: str = "monitor/",
    ) -> None:
        self.min_free_gb = min_free_gb
        self.reward_std_threshold = reward_std_threshold
        self.reward_std_after_step = reward_std_after_step
        self.grad_norm_threshold = grad_norm_threshold
        self.prefix = prefix
        self._trainer: weakref.ReferenceType[Any] | None = None
        self._per_rank: dict[int, dict[str, float]] = {}
        self._nvml = True  # set False after the first failure: NVML absent stays absent
        self._last_checked_step: int | None = None

    # -------------------------------------------------------------------------------- wiring

    def attach(self, trainer: Any) -> GRPOMonitorCallback:
        """Register on ``trainer`` ahead of the ``report_to`` loggers and give access to its rewards."""
        self._trainer = weakref.ref(trainer)
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    @property
    def trainer(self) -> Any:
        return self._trainer() if self._trainer is not None else None

    # ---------------------------------------------------------------------------- collecting

    def local_metrics(self) -> dict[str, float]:
        """This rank's memory (and utilization) figures, in GiB / percent."""
        out: dict[str, float] = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            free, _total = torch.cuda.mem_get_info(device)
            out["memory_allocated_gb"] = torch.cuda.memory_allocated(device) / GiB
            out["memory_peak_gb"] = torch.cuda.max_memory_allocated(device) / GiB
            out["memory_free_gb"] = free / GiB
            if self._nvml:
                try:
                    out["gpu_utilization"] = float(torch.cuda.utilization(device))
                except Exception:  # pynvml missing or NVML unusable (containers, MIG): skip the metric
                    self._nvml = False
        else:
            rss = _rss_bytes()
            if rss is not None:
                out["cpu_rss_gb"] = rss / GiB
            out["cpu_peak_rss_gb"] = _peak_rss_bytes() / GiB
        return out

    def _gather(self, local: dict[str, float]) -> dict[int, dict[str, float]]:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            return {rank: local}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return dict(enumerate(gathered))

    def reward_group_std(self) -> torch.Tensor | None:
        """In-group reward stds of the trainer's latest generation batch, or None when unavailable."""
        trainer = self.trainer
        logs = getattr(trainer, "_logs", None)
        if trainer is None or not isinstance(logs, Mapping) or not logs.get("rewards"):
            return None
        names = list(getattr(trainer, "reward_func_names", None) or logs["rewards"].keys())
        columns = [list(logs["rewards"][n]) for n in names if n in logs["rewards"]]
        if not columns or not columns[0]:
            return None
        per_func = torch.tensor(columns, dtype=torch.float64).T  # (completions, functions)
        weights = getattr(trainer, "reward_weights", None)
        w = (torch.as_tensor(weights, dtype=torch.float64).cpu() if weights is not None
             else torch.ones(per_func.shape[1], dtype=torch.float64))
        rewards = torch.nansum(per_func * w, dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = float("nan")  # unscorable rows, as TRL does
        num_generations = int(getattr(trainer, "num_generations", 0) or getattr(trainer.args, "num_generations", 0))
        if num_generations < 2:
            return None
        return in_group_reward_std(rewards, num_generations)

    # ---------------------------------------------------------------------------- thresholds

    def check(self, values: Mapping[str, float], *, step: int, rank: int | None = None) -> list[str]:
        """Messages for every threshold ``values`` crosses; each is also issued as a :class:`MonitorWarning`.

        Keys read: ``memory_free_gb``, ``reward_group_std``, ``grad_norm`` (missing ones are skipped).
        """
        where = f"rank {rank}: " if rank is not None else ""
        messages = []
        free = values.get("memory_free_gb")
        if free is not None and free < self.min_free_gb:
            messages.append(f"{where}{free:.2f} GiB free on the GPU, under {self.min_free_gb:g} GiB: the next long "
                            f"batch may run out of memory; lower per_device_train_batch_size or max_completion_length.")
        std = values.get("reward_group_std")
        if std is not None and math.isfinite(std) and step >= self.reward_std_after_step and std > self.reward_std_threshold:
            messages.append(f"{where}in-group reward std {std:.3f} > {self.reward_std_threshold:g} at step {step} "
                            f"(after {self.reward_std_after_step}): the policy may be overfitting (every completion of a prompt scores alike).")
        grad = values.get("grad_norm")
        if grad is not None and math.isfinite(grad) and grad > self.grad_norm_threshold:
            messages.append(f"{where}gradient norm {grad:.3g} > {self.grad_norm_threshold:g} at step {step}: a spike "
                            f"(stable training keeps it within 0.1-1.0); check the learning rate and the rewards.")
        for m in messages:
            warnings.warn(f"grpo_patches.monitor: {m}", MonitorWarning, stacklevel=2)
        return messages

    # ------------------------------------------------------------------------------ callbacks

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._per_rank = self._gather(self.local_metrics())

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None:
            return
        per_rank = self._per_rank or self._gather_local_only()
        metrics: dict[str, float] = {}
        for rank, values in sorted(per_rank.items()):
            for key, value in values.items():
                metrics[f"{self.prefix}rank{rank}/{key}"] = round(float(value), 4)
        stds = self.reward_group_std()
        group_std = None
        if stds is not None and not torch.isnan(stds).all():
            group_std = float(torch.nanmean(stds))
            metrics[f"{self.prefix}reward_group_std"] = group_std
            metrics[f"{self.prefix}reward_group_std_max"] = float(stds[~torch.isnan(stds)].max())
        logs.update(metrics)
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(metrics)  # Trainer.log appended a copy of `logs` just before calling us

        if state.global_step == self._last_checked_step:
            return  # the end-of-training summary logs again at the same step: warn once per step
        self._last_checked_step = state.global_step
        own = per_rank.get(_rank(), {})
        if "memory_free_gb" in own:
            self.check({"memory_free_gb": own["memory_free_gb"]}, step=state.global_step, rank=_rank())
        if state.is_world_process_zero:  # global figures: warn once, not once per rank
            self.check({k: v for k, v in (("reward_group_std", group_std), ("grad_norm", logs.get("grad_norm")))
                        if isinstance(v, (int, float))}, step=state.global_step)

    def _gather_local_only(self) -> dict[int, dict[str, float]]:
        return {_rank(): self.local_metrics()}


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
