"""``--plan``: every way to lay the run out over the GPUs, the ones that fit, cheapest first.

The choices: sharding (ddp, zero2, fsdp2, zero3 with and without TRL's whole-model gather for
generation) x base precision (the given dtype, int8, nf4 with double quantization) x CPU offload of
the frozen base (fsdp2 / zero3) x gradient checkpointing x reward placement (when reward models are
given; main placement is refused by the kit under DeepSpeed). Each is estimated by
:func:`grpo_patches.preflight.preflight`, so the memory model is the one documented there. Beside
them, layer splits (:mod:`grpo_patches.preflight.pipeline_split`): the decoder's layers over P GPUs of
one process, alone or data parallel over ``world_size / P`` such pipelines, in each base precision,
with and without checkpointing. Every entry names its launch: the script and the accelerate config
in ``examples/`` that run it.

Cost model (stated, not measured): the extra time per generation round (one generation batch and
its ``steps_per_generation`` micro-batches) that a layout adds over a replicated bf16 base with
activations kept:

- all-gathers of a sharded base, bytes received per rank ``(world - 1) / world x base bytes`` per
  pass over the base, at ``link_gbps`` (GB/s per GPU over the interconnect);
- host -> GPU copies of offloaded shards, ``base bytes / world`` per pass, at ``host_gbps``;
- bitsandbytes' dequantization, writing and reading a compute-dtype copy of every Linear per pass,
  at ``hbm_gbps``;
- gradient checkpointing's second forward, ``2 x parameters x tokens`` FLOPs per micro-batch, at
  ``tflops``.

Ranking: combinations that fit with 2 GiB free on every GPU come first, then those that fit
tighter; within each, cheapest first; at equal cost the simpler setup (ddp, fsdp2, zero2, zero3; no
quantization) and then the smaller peak.

Passes per round: ``completion_length`` decoding steps (TRL's FSDP2 and ``ds3_gather_for_generation=
False`` paths gather every layer at each one; the default ZeRO-3 path gathers the model once), then
per micro-batch a forward and a backward, plus a reference forward when ``beta > 0``. Quantization
also changes the model the adapter is trained on (QLoRA): the table says so rather than pricing it.
The defaults describe the article's RTX 3090s on PCIe 4.0 without NVLink (the figure is for ranking,
not a step-time prediction).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_patches.preflight.layout import Layout, RoundCost
from grpo_patches.preflight.pipeline import preflight
from grpo_patches.preflight.pipeline_split import SplitLayout, estimate_split, split_round_cost
from grpo_patches.preflight.settings import check_setting_names, dtype_bytes, setting

__all__ = ["KNOWN_FAILURES", "CostModel", "Plan", "PlanEntry", "plan"]

GiB = 2**30

#: Layouts that fit in memory but were seen to fail with stock TRL, and what was seen. The plan lists
#: them (column "fits": "fails") and never recommends them; a layout leaves this table when a run of it
#: passes. Keyed by (sharding, quantization, offload_base).
KNOWN_FAILURES: dict[tuple[str, str | None, bool], str] = {
    ("fsdp2", None, True): (
        "fails under TRL 1.16 / transformers 5.17: generate() puts the prompt on the CPU, where the offloaded "
        "model says it lives ('index is on cpu'; one H200, benchmarks/results/2026-12-01-h200-preflight-sharded/"
        "fsdp2-offload-1.5b.log)"),
}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Bandwidths the cost model turns bytes into seconds with (GB/s = 1e9 bytes/s; TFLOPS = 1e12)."""

    link_gbps: float = 10.0  # all-gather throughput per GPU: PCIe 4.0 x16 peer traffic, no NVLink
    host_gbps: float = 10.0  # host -> GPU per GPU with 4 GPUs sharing the CPU's lanes
    hbm_gbps: float = 900.0  # RTX 3090: 936 GB/s
    tflops: float = 70.0  # RTX 3090 dense bf16 tensor throughput (fp16 accumulate)

    def seconds(self, cost: RoundCost) -> float:
        return cost.seconds(link_gbps=self.link_gbps, host_gbps=self.host_gbps, hbm_gbps=self.hbm_gbps,
                            tflops=self.tflops)


@dataclasses.dataclass
class PlanEntry:
    """One combination: its layout, checkpointing, reward placement, the preflight report and the cost."""

    layout: Layout | SplitLayout
    checkpointing: bool
    placement: str
    report: Any  # PreflightReport
    cost: RoundCost
    seconds: float

    @property
    def fits(self) -> bool:
        """Fits in memory (whether it runs is :attr:`known_failure`)."""
        return bool(self.report.ok and self.report.fits)

    @property
    def known_failure(self) -> str:
        """Why this layout does not run with stock TRL although it fits ("" if none is known)."""
        return (KNOWN_FAILURES.get((self.layout.sharding, self.layout.quantization, self.layout.offload_base), "")
                or getattr(self.layout, "refused", ""))

    @property
    def usable(self) -> bool:
        return self.fits and not self.known_failure

    @property
    def required(self) -> int:
        return max(r.required for r in self.report.ranks)

    @property
    def worst(self) -> Any:
        return max(self.report.ranks, key=lambda r: r.required)

    @property
    def tight(self) -> bool:
        """Fits, but some GPU keeps under 2 GiB free."""
        return self.fits and min(r.headroom or 0 for r in self.report.ranks) < 2 * GiB

    def label(self) -> str:
        text = self.layout.label() + (" ckpt" if self.checkpointing else "")
        return text + (f" rewards={self.placement}" if self.placement != "local" else "")

    @property
    def launch(self) -> dict[str, str]:
        """The example script and accelerate config (paths in the repository) that run this layout."""
        if isinstance(self.layout, SplitLayout):
            return self.layout.launch()
        config = f"examples/accelerate/{self.layout.sharding}.yaml"
        return {"script": "examples/train_grpo_lora.py", "config": config,
                "command": f"accelerate launch --config_file {config} examples/train_grpo_lora.py"}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (``grpo-patches doctor --plan --json``): the layout, whether and how it fits, its
        cost per round, memory per GPU, what to set and the launch that runs it; the full report."""
        c = self.cost
        return {"label": self.label(), "sharding": self.layout.sharding, "quantization": self.layout.quantization,
                "offload_base": self.layout.offload_base, "gradient_checkpointing": self.checkpointing,
                "reward_placement": self.placement, "fits": self.fits, "tight": self.tight,
                "known_failure": self.known_failure or None, "required": self.required,
                "extra_seconds_per_round": round(self.seconds, 3),
                "cost": {"gather_gb": c.gather_bytes / 1e9, "host_gb": c.host_bytes / 1e9,
                         "dequant_gb": c.dequant_bytes / 1e9, "recompute_tflop": c.recompute_flops / 1e12,
                         "idle_tflop": c.idle_flops / 1e12, "boundary_gb": c.boundary_bytes / 1e9,
                         "fixed_seconds": c.fixed_seconds},
                "needed_gib_per_gpu": [round(r.required / GiB, 3) for r in self.report.ranks],
                "peak_gib_per_gpu": [round(r.peak / GiB, 3) for r in self.report.ranks],
                "peak_phase": self.worst.peak_phase, "launch": self.launch, "settings": self.settings(),
                "report": self.report.to_dict()}

    def settings(self) -> str:
        """What to set to run it: the accelerate config and the kit / TRL / transformers settings."""
        if isinstance(self.layout, SplitLayout):
            s = self.report.settings
            out = [self.launch["command"],
                   f"{s['gpus_per_process']} GPUs per process, layers per GPU {s['layers_per_stage']}",
                   f"per_device_train_batch_size={s['per_device_train_batch_size']} (one share per GPU)"]
            if self.layout.quantization == "nf4":
                out.append(f"BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                           f"bnb_4bit_use_double_quant={self.layout.double_quant})")
            elif self.layout.quantization == "int8":
                out.append("BitsAndBytesConfig(load_in_8bit=True)")
            out.append(f"gradient_checkpointing={self.checkpointing}")
            return "; ".join(out)
        out = {"ddp": ["examples/accelerate/ddp.yaml"], "zero2": ["examples/accelerate/zero2.yaml"],
               "fsdp2": ["examples/accelerate/fsdp2.yaml"], "zero3": ["examples/accelerate/zero3.yaml"]}[
            self.layout.sharding]
        if self.layout.offload_base:
            out.append("fsdp_offload_params: true" if self.layout.sharding == "fsdp2"
                       else "offload_param_device: cpu")
        if self.layout.quantization == "nf4":
            out.append("BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                       f"bnb_4bit_use_double_quant={self.layout.double_quant}"
                       + (", bnb_4bit_quant_storage=torch.bfloat16" if self.layout.sharded else "") + ")")
        elif self.layout.quantization == "int8":
            out.append("BitsAndBytesConfig(load_in_8bit=True)")
        if self.layout.sharding == "zero3" and not self.layout.gather_for_generation:
            out.append("ds3_gather_for_generation=False")
        out.append(f"gradient_checkpointing={self.checkpointing}")
        if self.placement == "main":
            out.append("apply(reward_placement='main')")
        return "; ".join(out)


@dataclasses.dataclass
class Plan:
    entries: list[PlanEntry]  # every combination, fitting ones first, cheapest first
    capacity: int | None
    cost_model: CostModel
    show_unfit: int = 5  # how many of the closest combinations that do not fit the table shows

    @property
    def fitting(self) -> list[PlanEntry]:
        """Those that fit and are not known to fail (:data:`KNOWN_FAILURES`)."""
        return [e for e in self.entries if e.usable]

    @property
    def failing(self) -> list[PlanEntry]:
        """Those that fit in memory but are known to fail with stock TRL."""
        return [e for e in self.entries if e.fits and e.known_failure]

    @property
    def best(self) -> PlanEntry | None:
        return self.fitting[0] if self.fitting else None

    def to_dict(self) -> dict[str, Any]:
        """Every combination, fitting ones first, cheapest first (``grpo-patches doctor --plan --json``), the best
        one in full, and why nothing fits when nothing does."""
        best = self.best
        return {"capacity_gib": (self.capacity or 0) / GiB, "cost_model": dataclasses.asdict(self.cost_model),
                "combinations": len(self.entries), "best": best.to_dict() if best is not None else None,
                "entries": [e.to_dict() for e in self.entries],
                "shortfall": None if best is not None else self.shortfall()}

    def closest(self) -> PlanEntry:
        """The combination nearest to fitting: the smallest need over capacity."""
        return min(self.entries, key=lambda e: (not e.report.ok, e.required))

    def shortfall(self) -> str:
        """Why nothing fits: the closest combination, its peak phase and the components over the GPU."""
        e = self.closest()
        r = e.worst
        cap = r.capacity or 0
        if not e.report.ok and not any("needs" in x for x in e.report.errors):
            return f"no combination is valid: {e.report.errors[0]}"
        phase = r.peak_phase
        parts = sorted(r.components.items(), key=lambda kv: -kv[1])[:4]
        over = r.required - cap
        weights = r.components["weights"] + r.components["gathered_weights"]
        lines = [
            f"closest: {e.label()} needs {r.required / GiB:.2f} GiB on rank {r.rank} (peak in {phase}) of "
            f"{cap / GiB:.2f} GiB: over by {over / GiB:.2f} GiB ({100 * over / cap:.0f}%).",
            "  largest components: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in parts) + ".",
        ]
        usable = cap - r.overhead
        if weights > usable:
            lines.append(f"  the frozen base alone (resident {r.components['weights'] / GiB:.2f} + gathered "
                         f"{r.components['gathered_weights'] / GiB:.2f} GiB) is over the usable "
                         f"{usable / GiB:.2f} GiB by {(weights - usable) / GiB:.2f} GiB.")
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = [("#", "layout", "peak GiB (phase)", "needed/GPU", "fits", "extra s/round",
                 "gather GB", "host GB", "dequant GB", "recompute TFLOP", "idle TFLOP", "boundary GB",
                 "host RAM GiB/rank")]
        shown = self.fitting + self.failing + [e for e in self.entries if not e.fits][:self.show_unfit]
        for i, e in enumerate(shown, 1):
            c = e.cost
            rows.append((str(i), e.label(), f"{e.worst.peak / GiB:.2f} ({e.worst.peak_phase})",
                         f"{e.required / GiB:.2f}",
                         "fails" if e.known_failure and e.fits else ("tight" if e.tight else "yes") if e.fits else "NO",
                         f"{e.seconds:.1f}", f"{c.gather_bytes / 1e9:.0f}", f"{c.host_bytes / 1e9:.0f}",
                         f"{c.dequant_bytes / 1e9:.0f}", f"{c.recompute_flops / 1e12:.0f}",
                         f"{c.idle_flops / 1e12:.0f}", f"{c.boundary_bytes / 1e9:.1f}",
                         f"{e.report.settings['host_weights_gb']:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = ["  ".join(cell.ljust(w) if j == 1 else cell.rjust(w) for j, (cell, w) in
                           enumerate(zip(row, widths, strict=True))) for row in rows]
        cm = self.cost_model
        failing = (f" (and {len(self.failing)} more that fit but are known to fail with stock TRL)"
                   if self.failing else "")
        head = [f"plan: {len(self.fitting)} of {len(self.entries)} combinations fit{failing} in "
                f"{(self.capacity or 0) / GiB:.2f} GiB per GPU; cost model: extra seconds per generation round at "
                f"{cm.link_gbps:g} GB/s interconnect, {cm.host_gbps:g} GB/s host->GPU, {cm.hbm_gbps:g} GB/s HBM, "
                f"{cm.tflops:g} TFLOPS (grpo_patches/preflight/plan.py)"]
        if self.best is not None:
            b = self.best
            head.append(f"cheapest that fits{' (under 2 GiB free)' if b.tight else ''}: {b.label()} -> "
                        f"{b.settings()}")
            if b.layout.quantization:
                head.append("  (a quantized base trains the adapter on a quantized model: QLoRA)")
            if isinstance(b.layout, SplitLayout):
                head.append("  per GPU of the pipeline: " + ", ".join(
                    f"{r.required / GiB:.2f}" for r in b.report.ranks) + " GiB needed")
        else:
            head.append("nothing fits. " + self.shortfall())
        hidden = len(self.entries) - len(shown)
        tail = [f"({hidden} more that do not fit are not shown; --json lists them all)"] if hidden else []
        tail += sorted({f"fails: {e.label()}: {e.known_failure}" for e in self.failing})
        return "\n".join(head + table + tail)


def _layouts(world_size: int) -> list[Layout]:
    out = []
    for sharding, quant in itertools.product(("ddp", "zero2", "fsdp2", "zero3"), (None, "int8", "nf4")):
        offloads = (False, True) if sharding in ("fsdp2", "zero3") and quant is None else (False,)
        gathers = (True, False) if sharding == "zero3" else (True,)
        for offload, gather in itertools.product(offloads, gathers):
            out.append(Layout(sharding=sharding, quantization=quant, offload_base=offload,
                              gather_for_generation=gather))
    return out


def _split_entries(model_config: Any, base: dict[str, Any], *, world_size: int, gpu_memory_gb: float,
                   reward_models: Sequence[Any], cost_model: CostModel, **preflight_kwargs: Any) -> list[PlanEntry]:
    """The layer splits: P GPUs per process for every P >= 2 dividing the GPUs, x base precision x
    checkpointing (rewards on each process's first GPU)."""
    from grpo_patches.preflight.count import architecture
    from grpo_patches.preflight.settings import load_model_config

    arch = architecture(load_model_config(model_config))
    entries = []
    for stages in (p for p in range(2, world_size + 1) if world_size % p == 0 and p <= arch.layers):
        for quant, ckpt in itertools.product((None, "int8", "nf4"), (False, True)):
            layout = SplitLayout(stages, world_size // stages, quant)
            settings = {**base, "gradient_checkpointing": ckpt}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = estimate_split(model_config, layout, grpo_config=settings, gpu_memory_gb=gpu_memory_gb,
                                        reward_models=reward_models, **preflight_kwargs)
            s = report.settings
            per_gpu = dict(s, per_device_train_batch_size=s["per_device_train_batch_size"] // stages,
                           act=dtype_bytes(s["compute_dtype"]))
            cost = split_round_cost(layout, report.params, arch.hidden, per_gpu,
                                    beta=float(setting(settings, "beta", 0.0) or 0.0))
            entries.append(PlanEntry(layout, ckpt, "local", report, cost, cost_model.seconds(cost)))
    return entries


def plan(model_config: Any, *, grpo_config: Any = None, world_size: int = 1, gpu_memory_gb: float,
         reward_models: Sequence[Any] = (), cost_model: CostModel | None = None,
         **preflight_kwargs: Any) -> Plan:
    """Estimate every combination (see the module docstring) and rank them.

    ``preflight_kwargs`` go to :func:`~grpo_patches.preflight.preflight` (prompt_length, dtype, ...);
    ``sharding`` / ``quantization`` / ``offload_base`` / ``reward_placement`` and the config's
    ``gradient_checkpointing`` / ``ds3_gather_for_generation`` are what the plan varies.
    """
    check_setting_names(grpo_config)
    varied = {"sharding", "quantization", "offload_base", "reward_placement", "double_quant"} & set(preflight_kwargs)
    if varied:
        raise TypeError(f"plan() varies {', '.join(sorted(varied))} itself; leave them out.")
    cost_model = cost_model or CostModel()
    base = dict(grpo_config) if isinstance(grpo_config, Mapping) else (
        {} if grpo_config is None else {k: v for k, v in vars(grpo_config).items() if not k.startswith("_")})
    placements = ("local", "main") if reward_models and world_size > 1 else ("local",)
    entries = []
    for layout, ckpt, placement in itertools.product(_layouts(world_size), (False, True), placements):
        if placement == "main" and layout.deepspeed:
            continue  # the kit refuses main placement under DeepSpeed (targets/trl_glue.py)
        settings = {**base, "gradient_checkpointing": ckpt, "ds3_gather_for_generation": layout.gather_for_generation}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = preflight(model_config, grpo_config=settings, world_size=world_size, gpu_memory_gb=gpu_memory_gb,
                               reward_models=reward_models, reward_placement=placement, sharding=layout.sharding,
                               quantization=layout.quantization, double_quant=layout.double_quant,
                               offload_base=layout.offload_base, raise_on_error=False, warn=False, **preflight_kwargs)
        s = report.settings
        batch, steps, completion = s["per_device_train_batch_size"], s["steps_per_generation"], s["completion_length"]
        beta = float(setting(settings, "beta", 0.0) or 0.0)
        cost = layout.round_cost(report.params, dtype_bytes(s["dtype"]), world_size,
                                 base_forwards=steps * (2 + (beta > 0)), generation_forwards=completion,
                                 act=dtype_bytes(s["compute_dtype"]))
        if ckpt:
            tokens = batch * (s["prompt_length"] + completion)
            cost = dataclasses.replace(cost, recompute_flops=steps * 2 * report.params.total * tokens)
        entries.append(PlanEntry(layout, ckpt, placement, report, cost, cost_model.seconds(cost)))
    # Fits that keep 2 GiB free per GPU first (those known to fail after every other fit); then by
    # cost; at equal cost the simpler setup (no DeepSpeed, no quantization), then the smaller peak.
    entries += _split_entries(model_config, base, world_size=world_size, gpu_memory_gb=gpu_memory_gb,
                              reward_models=reward_models, cost_model=cost_model, **preflight_kwargs)
    entries.sort(key=lambda e: (not e.fits, bool(e.known_failure), e.tight,
                                e.seconds if e.fits else e.required,
                                ("ddp", "fsdp2", "zero2", "zero3", "pipeline").index(e.layout.sharding)
                                + (e.layout.quantization is not None), e.required))
    capacity = int(gpu_memory_gb * GiB)
    return Plan(entries, capacity, cost_model)
