"""Layer-split layouts: the policy's decoder layers split across the GPUs of one process.

This is the ``device_map`` pipeline transformers and accelerate build (``from_pretrained(...,
device_map=..., max_memory=...)``): each GPU keeps whole layers, only the hidden states cross GPUs,
and the Trainer runs the model in one process. With ``replicas`` > 1 it is data parallelism over such
pipelines: D processes, each driving P GPUs, with the kit's rank-local groups on the D ranks.

Memory per GPU (stage i of P, holding ``l_i`` decoder layers): its layers' frozen weights (in the
base's precision), their LoRA weights, gradients and optimizer state, the KV cache of its layers, the
activations autograd keeps for its layers, the hidden state it receives from the stage before (and
keeps for backward); the embedding on the first stage, the final norm, LM head and log-prob tiles on
the last (a tied head stays with the embedding on the first); reward models on the first (the
process's own device). Each stage is estimated by the same model as a data-parallel rank
(:func:`~grpo_patches.preflight.estimate.estimate_ranks`) on the stage's share of the layers.

Settings: the user's per-GPU settings describe one GPU's share, so a process driving P GPUs takes P
shares (``per_device_train_batch_size`` x P, the same ``steps_per_generation``): the same completions
per optimizer step as P data-parallel ranks.

Time: extra seconds per generation round over a replicated bf16 base with activations kept (the
unit of every ``--plan`` layout), at the same completions per round:

- no gathers: every GPU keeps its layers; a decoding step reads each stage's weights once, one stage
  after the other, i.e. the whole base once per step, as a replicated rank does: weight reads add
  nothing (a quantized base still pays bitsandbytes' dequantization, priced as for every layout);
- stages in turn (a naive pipeline keeps one GPU busy at a time): the P shares' arithmetic runs on one
  GPU at a time, so P - 1 shares' worth of every FLOP a data-parallel rank does per round (prefill and
  decoding of its completions, forward, backward, reference forward and checkpointing's recompute) is
  time the pipeline adds. Priced at ``tflops`` as if compute-bound: exact for the training passes, an
  upper bound for decoding, whose steps are memory-bound at small batch;
- the boundary activations: P - 1 boundaries, each crossed by the hidden state of every token in
  every pass (forward; backward sends its gradient), at ``link_gbps``, plus a fixed latency per hop
  and decoding step (``coefficients.json``'s ``pipeline``);
- checkpointing's recompute and the dequantization traffic, as for the other layouts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo_patches.preflight.advise import check_shapes
from grpo_patches.preflight.count import Arch, ParamCount, architecture, count_parameters, count_reward_models
from grpo_patches.preflight.estimate import activation_bytes, estimate_inputs, estimate_ranks, sampling_bytes
from grpo_patches.preflight.layout import Layout, RoundCost
from grpo_patches.preflight.report import GiB, PreflightReport, RankEstimate
from grpo_patches.preflight.settings import (
    RunSettings,
    dtype_name,
    load_model_config,
    resolve_settings,
    reward_specs,
)

__all__ = ["PIPELINE_COEFFICIENTS", "SplitLayout", "estimate_split", "layers_per_stage", "split_round_cost",
           "stage_params"]

#: Stated constants of the pipeline cost model (coefficients.json: what each is).
PIPELINE_COEFFICIENTS: dict[str, Any] = json.loads(
    (Path(__file__).with_name("coefficients.json")).read_text())["pipeline"]

SCRIPT = "examples/train_grpo_split.py"


@dataclasses.dataclass(frozen=True)
class SplitLayout:
    """``stages`` GPUs per process holding whole decoder layers, ``replicas`` such processes (data parallel),
    the frozen base in ``quantization`` (None / "nf4" / "int8", bitsandbytes)."""

    stages: int
    replicas: int = 1
    quantization: str | None = None
    double_quant: bool = True
    # read by the plan like a Layout's: nothing gathered, nothing offloaded, no DeepSpeed
    sharding: str = dataclasses.field(default="pipeline", init=False)
    offload_base: bool = dataclasses.field(default=False, init=False)
    gather_for_generation: bool = dataclasses.field(default=True, init=False)
    sharded: bool = dataclasses.field(default=False, init=False)
    deepspeed: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.stages < 2 or self.replicas < 1:
            raise ValueError(f"a layer split needs stages >= 2 and replicas >= 1, not {self.stages} x {self.replicas}.")
        Layout(quantization=self.quantization)  # refuses an unknown quantization

    @property
    def gpus(self) -> int:
        return self.stages * self.replicas

    def label(self) -> str:
        text = f"pipeline {self.stages}" + (f" x dp {self.replicas}" if self.replicas > 1 else "")
        if self.quantization:
            text += " " + self.quantization + ("+dq" if self.quantization == "nf4" and self.double_quant else "")
        return text

    @property
    def refused(self) -> str:
        """Why the stack refuses this layout ("" if it runs)."""
        if self.replicas > 1 and self.quantization is not None:
            return ("accelerate (1.15) refuses a 4-/8-bit model spread over several GPUs in any distributed mode "
                    "('loaded in 8-bit or 4-bit precision on multiple devices'): quantized pipelines run one process")
        return ""

    def launch(self) -> dict[str, str]:
        """The command that runs it: the example script and the accelerate config (present in the repository)."""
        config = ("examples/accelerate/pipeline.yaml" if self.replicas == 1
                  else "examples/accelerate/pipeline_dp.yaml")
        args = f"--stages {self.stages}" + (f" --quantization {self.quantization}" if self.quantization else "")
        processes = f" --num_processes {self.replicas}" if self.replicas > 2 else ""
        return {"script": SCRIPT, "config": config,
                "command": f"accelerate launch --config_file {config}{processes} {SCRIPT} {args}"}


def layers_per_stage(layers: int, stages: int) -> list[int]:
    """An even split; the remainder goes to the middle stages first (the ends carry the embedding and head)."""
    if layers < stages:
        raise ValueError(f"{layers} decoder layers cannot be split over {stages} stages.")
    base, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), abs(i - (stages - 1) / 2)))
    out = [base] * stages
    for i in order[:extra]:
        out[i] += 1
    return out


def stage_params(params: ParamCount, layers: int, *, first: bool, last: bool) -> ParamCount:
    """The parameters one stage holds: ``layers`` decoder layers (LoRA included: the adapter sits on the
    decoder's Linears), the embedding on the first stage, the final norm and an untied LM head on the last."""
    share = layers / max(params.layers, 1)
    per_layer = len(params.linear_sizes) // max(params.layers, 1)
    linear = round(params.linear_frozen * share)
    root_other = (params.frozen - params.linear_frozen - params.layers * params.layer_other
                  - params.embedding - params.output_embedding)  # the final norm
    frozen = (linear + layers * params.layer_other + (params.embedding if first else 0)
              + ((params.output_embedding + root_other) if last else 0))
    trainable = round(params.trainable * share)
    return dataclasses.replace(
        params, total=frozen + trainable, trainable=trainable, reference_trainable=round(params.reference_trainable * share),
        embedding=params.embedding if first else 0, output_embedding=params.output_embedding if last else 0,
        linear_frozen=linear, linear_rows=round(params.linear_rows * share), layers=layers,
        linear_sizes=params.linear_sizes[:per_layer * layers], frozen_sizes=(), adapted=round(params.adapted * share))


def estimate_split(model_config: Any, layout: SplitLayout, *, grpo_config: Any = None, lora_config: Any = None,
                   gpu_memory_gb: float | None = None, reward_models: Sequence[Any] = (),
                   prompt_length: int | None = None, dtype: Any = None, logits_mode: str = "auto",
                   overhead_gb: float = 1.0, fragmentation: float = 0.05, lean_lora: bool = False,
                   layers: Sequence[int] | None = None, **_ignored: Any) -> PreflightReport:
    """Each GPU of one pipeline (they are alike across replicas) as a :class:`PreflightReport` whose
    ``ranks`` are the P stages (``rank`` = the GPU's index in its pipeline); the grpo settings are per GPU.
    ``layers``: decoder layers per stage (the example's ``--layers``), for an uneven split such as a GPU
    with most layers and the CPU with the rest; default :func:`layers_per_stage`'s even split."""
    per_gpu = resolve_settings(grpo_config, lora_config=lora_config, world_size=layout.gpus,
                               gpu_memory_gb=gpu_memory_gb, reward_placement="local", prompt_length=prompt_length,
                               dtype=dtype, logits_mode=logits_mode)
    s = dataclasses.replace(per_gpu, world_size=layout.replicas, batch=per_gpu.batch * layout.stages)
    cfg = load_model_config(model_config)
    arch = architecture(cfg)
    params = count_parameters(cfg, s.lora)
    specs, _ = reward_specs(reward_models)
    rewards = count_reward_models(specs)
    base = Layout(quantization=layout.quantization, double_quant=layout.double_quant)
    capacity = int(gpu_memory_gb * GiB) if gpu_memory_gb is not None else None
    common, _ = estimate_inputs(s, arch, params, base, rewards, capacity=capacity, overhead=int(overhead_gb * GiB),
                                fragmentation=fragmentation, fast_generation=False, lean_lora=lean_lora)
    tied = params.output_embedding == 0
    n_gen, tokens = s.batch * s.steps, s.batch * (s.prompt + s.completion)
    stages = []
    counts = list(layers) if layers is not None else layers_per_stage(arch.layers, layout.stages)
    if len(counts) != layout.stages or sum(counts) != arch.layers or min(counts) < 1:
        raise ValueError(f"layers {counts} must give {layout.stages} positive counts summing to {arch.layers}.")
    for i, layers in enumerate(counts):
        first, last = i == 0, i == layout.stages - 1
        head_here = first if tied else last
        sp = stage_params(params, layers, first=first, last=last)
        sarch = dataclasses.replace(arch, layers=layers)
        r = estimate_ranks(sarch, sp, checkpointing=s.checkpointing,
                           **{**common, "rewards": rewards if first else []})[0]
        comp, phases = dict(r.components), dict(r.phases)
        if not head_here:  # no log-prob tiles, no sampling logits
            phases["training"] -= comp["logits_logps"]
            sampling = sampling_bytes(arch, n_gen, s.act, s.sampler, fused=False)
            phases["generation"] -= sampling
            comp["generation_transient"] -= sampling
            comp["logits_logps"] = 0
        # the hidden state received from the stage before, kept for backward (its gradient goes back)
        comp["boundary"] = 0 if first else tokens * arch.hidden * s.act
        phases["training"] += comp["boundary"]
        stages.append(RankEstimate(i, comp, phases, capacity, r.overhead, r.fragmentation))
    errors = [str(e) for e in check_shapes(s)]
    over = [r for r in stages if r.fits is False]
    if over:
        worst = max(over, key=lambda r: r.required)
        errors.append(f"GPU {worst.rank} of the pipeline needs {worst.required / GiB:.2f} GiB of "
                      f"{(capacity or 0) / GiB:.2f} GiB (peak in {worst.peak_phase}).")
    settings = dict(world_size=s.world_size, per_device_train_batch_size=s.batch, steps_per_generation=s.steps,
                    num_generations=s.num_generations, prompt_length=s.prompt, completion_length=s.completion,
                    gradient_checkpointing=s.checkpointing, dtype=dtype_name(s.dtype), compute_dtype=s.compute_dtype,
                    logits_mode=s.logits_mode, reward_placement="local", optim=s.optim, layout=layout.label(),
                    host_weights_gb=0.0, layers_per_stage=counts, gpus_per_process=layout.stages)
    act_ckpt = activation_bytes(arch, tokens, s.act, s.dropout, True)
    act_full = activation_bytes(arch, tokens, s.act, s.dropout, False)
    return PreflightReport(stages, params, settings, act_ckpt, act_full, errors, [])


def split_round_cost(layout: SplitLayout, params: ParamCount, arch: Arch | int, s: RunSettings | dict[str, Any], *,
                     beta: float = 0.0) -> RoundCost:
    """The module docstring's cost, from one GPU's share (``s``: the per-GPU settings, as a dict with
    per_device_train_batch_size / steps_per_generation / prompt_length / completion_length /
    gradient_checkpointing / compute_dtype's bytes as ``act``)."""
    hidden = arch if isinstance(arch, int) else arch.hidden
    g = s if isinstance(s, dict) else dict(per_device_train_batch_size=s.batch, steps_per_generation=s.steps,
                                            prompt_length=s.prompt, completion_length=s.completion,
                                            gradient_checkpointing=s.checkpointing, act=s.act)
    b, steps = g["per_device_train_batch_size"], g["steps_per_generation"]
    seq, completion, act = g["prompt_length"] + g["completion_length"], g["completion_length"], g["act"]
    passes = steps * (2 + (beta > 0))  # forward and backward (+ the reference forward) per micro-batch
    recompute = steps if g["gradient_checkpointing"] else 0
    n = params.total
    # one GPU's share of the arithmetic per round: generation (prefill + decoding) and the training passes
    share_flops = 2 * n * b * steps * seq + 2 * n * b * seq * (passes + recompute)
    p = layout.stages
    boundary_tokens = p * b * (steps * seq + seq * (passes + recompute))  # one pipeline's tokens over all passes
    coef = PIPELINE_COEFFICIENTS
    hops = (p - 1) * (completion + passes + recompute)
    dequant = 0.0
    if layout.quantization is not None:
        dequant = (passes + completion) * 2 * params.linear_frozen * act
    return RoundCost(dequant_bytes=dequant, recompute_flops=recompute * 2 * n * b * seq,
                     idle_flops=(p - 1) * share_flops,
                     boundary_bytes=(p - 1) * boundary_tokens * hidden * act * coef["boundary_tensors_per_token"],
                     fixed_seconds=hops * coef["hop_latency_s"])
