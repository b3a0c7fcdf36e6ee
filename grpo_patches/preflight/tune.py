"""``doctor --tune``: the micro-batch and generation batch for this GPU, at the user's completions per step.

The user's settings fix how many completions one optimizer step sees: ``per_device_train_batch_size
x gradient_accumulation_steps x world_size``. Every layout that keeps it is a candidate: a
micro-batch ``b`` dividing the per-rank completions ``n`` (accumulation ``a = n / b``) and a
``steps_per_generation`` ``s`` that divides ``a`` (the rank generates ``b x s`` completions at a
time, several rounds per optimizer step, all sampled by the weights the step updates). With
``allow_sample_ahead``, also ``s = 2a`` and ``4a``: one generation round feeds several optimizer
steps, so TRL adds a no-grad forward over every micro-batch for the old log-probs (counted in the
``passes`` column). Candidates whose rounds would cut a group (:func:`grouping.check_group_shape`)
are not listed. Each is estimated by :func:`grpo_patches.preflight.preflight`, so the memory model is
the one documented there, and kept when it fits with 2 GiB free on every GPU (the rule ``--plan``
ranks by).

The pick: the largest micro-batch that fits (fewest training passes per optimizer step: per-pass
costs such as kernel launches and the LoRA layers' bookkeeping are paid ``a`` times, and larger
matmuls run nearer peak), then for it the largest generation batch that fits (fewer decoding rounds:
a decode step reads the weights once whatever the batch). Memory only: the table is not a timing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from grpo_patches.grouping import GroupShapeError, check_group_shape
from grpo_patches.preflight.advise import _MIN_FREE_GB
from grpo_patches.preflight.pipeline import preflight
from grpo_patches.preflight.report import GiB, PreflightReport
from grpo_patches.preflight.settings import resolve_settings

__all__ = ["Candidate", "Tuning", "tune"]

SAMPLE_AHEAD = (2, 4)  # steps_per_generation = k x accumulation, with allow_sample_ahead


@dataclasses.dataclass
class Candidate:
    """One layout at the user's completions per step, and its preflight report."""

    micro_batch: int  # per_device_train_batch_size
    accumulation: int  # gradient_accumulation_steps
    steps_per_generation: int
    world_size: int
    report: PreflightReport

    @property
    def generation_batch(self) -> int:
        """Completions generated at once over all ranks (TRL's ``generation_batch_size``)."""
        return self.micro_batch * self.steps_per_generation * self.world_size

    @property
    def sample_ahead(self) -> bool:
        return self.steps_per_generation > self.accumulation

    @property
    def passes(self) -> int:
        """Forward passes per optimizer step on each rank: one per micro-batch (with its backward), and a
        no-grad one per micro-batch for the old log-probs when a round feeds several optimizer steps."""
        return self.accumulation * (2 if self.sample_ahead else 1)

    @property
    def required(self) -> int:
        return max(r.required for r in self.report.ranks)

    @property
    def fits(self) -> bool:
        """Fits with the headroom the plan keeps (``_MIN_FREE_GB`` free on every GPU)."""
        return bool(self.report.ok and self.report.fits
                    and min(r.headroom for r in self.report.ranks) >= _MIN_FREE_GB * GiB)

    def settings(self) -> dict[str, int]:
        return {"per_device_train_batch_size": self.micro_batch, "gradient_accumulation_steps": self.accumulation,
                "steps_per_generation": self.steps_per_generation}

    def to_dict(self) -> dict[str, Any]:
        return {**self.settings(), "generation_batch_size": self.generation_batch, "sample_ahead": self.sample_ahead,
                "passes": self.passes, "fits": self.fits, "peak_gib": round(self.report.peak / GiB, 3),
                "required_gib": round(self.required / GiB, 3), "peak_phase": max(
                    self.report.ranks, key=lambda r: r.required).peak_phase}


@dataclasses.dataclass
class Tuning:
    """Every candidate, the pick (None when none fits) and what was kept fixed."""

    candidates: list[Candidate]
    completions_per_step: int
    world_size: int
    gpu_memory_gb: float
    allow_sample_ahead: bool

    @property
    def best(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits]
        return max(fitting, key=lambda c: (c.micro_batch, c.generation_batch), default=None)

    @property
    def closest(self) -> Candidate:
        """The candidate needing the least memory: what to start from when none fits."""
        return min(self.candidates, key=lambda c: c.required)

    def advice(self) -> str:
        best = self.best
        if best is None:
            c = self.closest
            return (f"none fits on {self.gpu_memory_gb:g} GiB with {_MIN_FREE_GB:g} GiB free; closest: "
                    f"{_settings_text(c)} needs {c.required / GiB:.2f} GiB (peak in {c.to_dict()['peak_phase']}). "
                    f"Lower max_completion_length, turn on lean_lora, or run `doctor --plan` for sharded layouts.")
        return (f"pick: {_settings_text(best)} -> generation batch {best.generation_batch} "
                f"(= {best.micro_batch} x {best.steps_per_generation} x {self.world_size} ranks), "
                f"{best.required / GiB:.2f} GiB of {self.gpu_memory_gb:g}"
                + (f"; samples ahead of the optimizer: {best.passes} passes per step with the old log-probs"
                   if best.sample_ahead else "")
                + ". Rule: the largest micro-batch that fits (fewest passes per optimizer step), then the largest "
                  "generation batch that fits (fewest decoding rounds).")

    def __str__(self) -> str:
        head = (f"{self.completions_per_step} completions per optimizer step over {self.world_size} rank(s), "
                f"{self.gpu_memory_gb:g} GiB per GPU, {_MIN_FREE_GB:g} GiB kept free"
                + ("" if self.allow_sample_ahead else "; no sampling ahead of the optimizer (--allow-sample-ahead)"))
        rows = [f"{'micro-batch':>11} {'accum':>5} {'steps/gen':>9} {'gen batch':>9} {'passes':>6} "
                f"{'peak GiB':>8} {'needs GiB':>9}  fits"]
        for c in self.candidates:
            mark = "yes" if c.fits else ("tight" if c.report.ok and c.report.fits else "no")
            rows.append(f"{c.micro_batch:>11} {c.accumulation:>5} {c.steps_per_generation:>9} {c.generation_batch:>9} "
                        f"{c.passes:>6} {c.report.peak / GiB:>8.2f} {c.required / GiB:>9.2f}  {mark}"
                        + ("  <- pick" if c is self.best else ""))
        return "\n".join([head, *rows, self.advice()])

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"completions_per_step": self.completions_per_step, "world_size": self.world_size,
                "gpu_memory_gb": self.gpu_memory_gb, "min_free_gib": _MIN_FREE_GB,
                "allow_sample_ahead": self.allow_sample_ahead,
                "rule": "largest micro-batch that fits, then largest generation batch that fits",
                "candidates": [c.to_dict() for c in self.candidates],
                "pick": None if best is None else best.to_dict(),
                "closest": None if best is not None else self.closest.to_dict(), "advice": self.advice()}


def _settings_text(c: Candidate) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.settings().items())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _as_dict(grpo_config: Any) -> dict[str, Any]:
    if grpo_config is None:
        return {}
    if isinstance(grpo_config, Mapping):
        return dict(grpo_config)
    if hasattr(grpo_config, "to_dict"):  # a transformers TrainingArguments / GRPOConfig
        return dict(grpo_config.to_dict())
    return dict(vars(grpo_config))


def tune(model_config: Any, *, gpu_memory_gb: float, grpo_config: Any = None, world_size: int = 1,
         allow_sample_ahead: bool = False, **preflight_kwargs: Any) -> Tuning:
    """Estimate every layout at the user's completions per optimizer step and pick one (see the module doc).

    ``preflight_kwargs`` go to :func:`~grpo_patches.preflight.preflight` for every candidate
    (``lora_config``, ``prompt_length``, ``lean_lora``, ``fast_generation``, ...).
    """
    settings = _as_dict(grpo_config)
    s = resolve_settings(settings or None, lora_config=preflight_kwargs.get("lora_config"), world_size=world_size,
                         gpu_memory_gb=gpu_memory_gb, reward_placement=preflight_kwargs.get("reward_placement", "local"),
                         prompt_length=preflight_kwargs.get("prompt_length"), dtype=preflight_kwargs.get("dtype"),
                         logits_mode=preflight_kwargs.get("logits_mode", "auto"))
    per_rank = s.batch * s.accumulation
    for name in ("steps_per_generation", "generation_batch_size"):  # each candidate sets its own round
        settings.pop(name, None)
    candidates = []
    for b in _divisors(per_rank):
        a = per_rank // b
        steps = _divisors(a) + ([k * a for k in SAMPLE_AHEAD] if allow_sample_ahead else [])
        for sp in steps:
            try:
                check_group_shape(per_device_batch_size=b, steps_per_generation=sp,
                                  num_generations=s.num_generations, world_size=world_size)
            except GroupShapeError:
                continue  # a round would cut a group: never a candidate
            report = preflight(model_config, grpo_config={**settings, "per_device_train_batch_size": b,
                                                          "gradient_accumulation_steps": a, "steps_per_generation": sp},
                               world_size=world_size, gpu_memory_gb=gpu_memory_gb, raise_on_error=False, warn=False,
                               **preflight_kwargs)
            candidates.append(Candidate(b, a, sp, world_size, report))
    if not candidates:
        raise GroupShapeError(
            f"grpo_patches: no layout of {per_rank} completions per rank per step holds whole groups of "
            f"num_generations={s.num_generations}; make per_device_train_batch_size x gradient_accumulation_steps "
            f"a multiple of num_generations.")
    return Tuning(candidates, per_rank * world_size, world_size, gpu_memory_gb, allow_sample_ahead)
