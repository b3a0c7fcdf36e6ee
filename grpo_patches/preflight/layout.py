"""How the frozen base is laid out over the ranks: sharding, base precision, CPU offload.

Each :class:`Layout` says what one rank keeps of the frozen policy on its GPU, what it gathers while
a layer runs, and what it moves per generation round (the cost model of ``--plan``). The byte
formulas are the libraries' own layouts (each checked against the library on CPU in
``tests/test_preflight_layouts.py``):

- **nf4** (bitsandbytes ``Linear4bit``, QLoRA): 4 bits per weight of every decoder ``Linear`` plus
  an absmax per block of 64; with double quantization the absmax is itself 8-bit, blocks of 256, with
  one fp32 scale per block: 0.5 + 1/64 + 4/16384 bytes per weight (0.5 + 4/64 without). Embeddings,
  the LM head and norms stay in the compute dtype (transformers skips the output embedding).
- **int8** (``Linear8bitLt``, LLM.int8): 1 byte per weight plus an fp32 scale per output row.
- **ddp** / **zero2**: every rank holds the whole base (ZeRO-2 partitions gradients and optimizer
  state only, and a LoRA run has few of either).
- **fsdp2** (``fully_shard`` per decoder layer and on the root, as accelerate's transformer-based
  wrap does): each rank keeps 1/world of every parameter; a layer is all-gathered before its forward
  and again before its backward, and a group's all-gather buffer lives until the next group's
  copy-out, so two layers' worth is unsharded at once; the root's own parameters (embeddings, LM
  head, final norm) are gathered at the first forward and stay until backward ends, and the first
  layer's gather overlaps the root's buffer: max(2 root + layer, root + 2 layers) (measured with
  torch's ``FSDPMemTracker`` over gloo). Generation runs the sharded model: every decoding step
  gathers every layer again (TRL's ``summon_full_params`` is a no-op for FSDP2).
- **zero3** (DeepSpeed 0.19's ``stage3.py`` / ``partitioned_param_coordinator.py``, read from its source, the
  values from the DeepSpeed config (:class:`DeepSpeedSettings`, DeepSpeed's defaults where it says nothing;
  accelerate's ``deepspeed_config:`` block in a YAML sets none of them, so the defaults hold there):
  parameters of at most ``stage3_param_persistence_threshold`` elements (1e5; up to
  ``stage3_model_persistence_threshold`` in all) are persistent: whole on every rank, on the GPU even with
  offload; the rest keep 1/world. With ``contiguous_gradients`` (default on) the optimizer allocates a
  gradient bucket of ``reduce_bucket_size`` elements (5e8: 0.93 GiB in bf16) at init, resident in every phase.
  At world size 1 a gather is a view of the local partition (``_no_gather_coalesced``): no memory, unless the
  partition is in host memory (offload), when it is a GPU copy. TRL's default ``ds3_gather_for_generation=True``
  gathers the WHOLE model for generation (``GatheredParameters(model.parameters())``) and, on leaving, calls
  ``add_hooks``, which invalidates the coordinator's trace, so training runs in trace-recording mode: no
  prefetch, no ``stage3_max_reuse_distance`` retention, each module released after it runs; but with
  (reentrant) gradient checkpointing DeepSpeed attributes every frozen parameter gathered during a
  checkpoint's recompute to the outermost backward module still open (``update_recompute_parameters``),
  which releases them when the backward ends: by then the whole frozen base is gathered (measured on an
  H200 with offload, 0.5B and 1.5B). Without checkpointing: the largest of one layer and the LM head (TRL's
  fused head gathers it). ``ds3_gather_for_generation=False``: generation runs with a complete trace, one
  module + a prefetch of ``min(stage3_prefetch_bucket_size, stage3_max_live_parameters - live)`` elements,
  and a tied embedding, which comes back at the LM head, stays gathered through each forward when the decoder
  between them is within ``stage3_max_reuse_distance`` elements. Nothing is gathered in the optimizer step.
- **zero2**: the same contiguous gradient bucket (``reduce_bucket_size`` elements, twice with ``overlap_comm``),
  allocated at the first backward and kept.
- **offload** (FSDP2 ``CPUOffloadPolicy`` / ZeRO-3 ``offload_param``): the shards live in host memory
  and are copied to the GPU before each gather (plus one layer's shard of staging).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["QUANTIZATIONS", "SHARDINGS", "DeepSpeedSettings", "Layout", "RoundCost", "quantized_bytes_per_weight",
           "resolve_layout"]

SHARDINGS = ("ddp", "zero2", "fsdp2", "zero3")
QUANTIZATIONS = (None, "int8", "nf4")
_NF4_BLOCK, _NESTED_BLOCK = 64, 256


def _nf4_tensor_bytes(n: int, double_quant: bool) -> int:
    """One ``Params4bit`` as bitsandbytes stores it: packed 4-bit data, the absmax per block of 64, the
    16-entry code; with double quantization the absmax in 8 bits, an fp32 scale per 256 blocks and the
    256-entry nested code."""
    blocks = -(-n // _NF4_BLOCK)
    if not double_quant:
        return -(-n // 2) + 4 * blocks + 4 * 16
    return -(-n // 2) + blocks + 4 * -(-blocks // _NESTED_BLOCK) + 4 * 16 + 4 * 256


def quantized_bytes_per_weight(quantization: str | None, double_quant: bool = True) -> float | None:
    """Bytes per weight of a quantized ``Linear`` (without int8's per-row scales); None if not quantized."""
    if quantization is None:
        return None
    if quantization == "nf4":
        if double_quant:
            return 0.5 + 1 / _NF4_BLOCK + 4 / (_NF4_BLOCK * _NESTED_BLOCK)
        return 0.5 + 4 / _NF4_BLOCK
    if quantization == "int8":
        return 1.0
    raise ValueError(f"quantization={quantization!r} must be None, 'nf4' or 'int8'.")


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """The ``zero_optimization`` values the memory model reads, with DeepSpeed 0.19's defaults
    (``deepspeed/runtime/zero/config.py``). Sizes are in elements."""

    reduce_bucket_size: int = int(5e8)
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None  # DeepSpeed: True for stage 3, False below
    prefetch_bucket_size: int = int(5e7)
    max_live_parameters: int = int(1e9)
    max_reuse_distance: int = int(1e9)
    param_persistence_threshold: int = int(1e5)
    model_persistence_threshold: int = sys.maxsize
    offload_param: str = "none"
    communication_bytes: int | None = None  # communication_data_type; None: the compute dtype's

    @classmethod
    def from_config(cls, config: Any = None, hidden_size: int | None = None) -> DeepSpeedSettings:
        """From a DeepSpeed config: a dict, a JSON file path, a ``DeepSpeedSettings`` or None (the defaults).
        ``"auto"`` values are resolved as accelerate / transformers do for the model's ``hidden_size``:
        reduce_bucket_size hidden^2, stage3_prefetch_bucket_size 0.9 hidden^2,
        stage3_param_persistence_threshold 10 hidden."""
        if isinstance(config, cls):
            return config
        if config is None:
            return cls()
        if isinstance(config, (str, os.PathLike)):
            config = json.loads(Path(config).read_text())
        if not isinstance(config, Mapping):
            raise TypeError(f"deepspeed_config must be a dict, a JSON path or None, not {type(config).__name__}.")
        zero = dict(config.get("zero_optimization", {}) or {})
        h = hidden_size or 0
        auto = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                "stage3_param_persistence_threshold": 10 * h}

        def value(key: str, default: Any) -> Any:
            v = zero.get(key, default)
            if v == "auto":
                if key not in auto or not h:
                    return default
                return auto[key]
            return default if v is None else v

        d = cls()
        comm = config.get("communication_data_type")
        comm_bytes = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}.get(
            str(comm).lower()) if comm else None
        offload = zero.get("offload_param") or {}
        return cls(
            reduce_bucket_size=int(float(value("reduce_bucket_size", d.reduce_bucket_size))),
            contiguous_gradients=bool(value("contiguous_gradients", True)),
            overlap_comm=zero.get("overlap_comm"),
            prefetch_bucket_size=int(float(value("stage3_prefetch_bucket_size", d.prefetch_bucket_size))),
            max_live_parameters=int(float(value("stage3_max_live_parameters", d.max_live_parameters))),
            max_reuse_distance=int(float(value("stage3_max_reuse_distance", d.max_reuse_distance))),
            param_persistence_threshold=int(float(value("stage3_param_persistence_threshold",
                                                        d.param_persistence_threshold))),
            model_persistence_threshold=int(float(value("stage3_model_persistence_threshold",
                                                        d.model_persistence_threshold))),
            offload_param=str((offload.get("device") if isinstance(offload, Mapping) else None) or "none"),
            communication_bytes=comm_bytes,
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to place the frozen base: ``sharding`` in ddp / zero2 / fsdp2 / zero3, ``quantization``
    None / "nf4" / "int8" (bitsandbytes), ``offload_base`` (frozen shards in host memory; fsdp2 / zero3
    only), ``gather_for_generation`` (ZeRO-3: TRL's ``ds3_gather_for_generation``)."""

    sharding: str = "ddp"
    quantization: str | None = None
    double_quant: bool = True
    offload_base: bool = False
    gather_for_generation: bool = True
    ds: DeepSpeedSettings = dataclasses.field(default_factory=DeepSpeedSettings)

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding={self.sharding!r} must be one of {', '.join(SHARDINGS)}.")
        quantized_bytes_per_weight(self.quantization)
        if self.offload_base and self.sharding not in ("fsdp2", "zero3"):
            raise ValueError(
                f"offload_base=True needs sharding='fsdp2' (CPUOffloadPolicy) or 'zero3' (offload_param); "
                f"{self.sharding} keeps the base on the GPU (ZeRO-2 offloads only optimizer state)."
            )
        if self.offload_base and self.quantization is not None:
            raise ValueError(
                "offload_base=True with a quantized base: bitsandbytes runs quantized weights on the GPU only "
                "(offloaded modules stay unquantized); choose one."
            )

    @property
    def sharded(self) -> bool:
        return self.sharding in ("fsdp2", "zero3")

    @property
    def deepspeed(self) -> bool:
        return self.sharding.startswith("zero")

    def label(self) -> str:
        parts = [self.sharding]
        if self.quantization:
            parts.append(self.quantization + ("+dq" if self.quantization == "nf4" and self.double_quant else ""))
        if self.offload_base:
            parts.append("offload")
        if self.sharding == "zero3" and not self.gather_for_generation:
            parts.append("layerwise-generation")
        return " ".join(parts)

    # ------------------------------------------------------------------------------ bytes

    def base_bytes(self, params: Any, w_bytes: int) -> dict[str, float]:
        """The whole frozen base in this precision: decoder Linears, one layer, the root's own parameters."""
        per_weight = quantized_bytes_per_weight(self.quantization, self.double_quant)
        other = params.frozen - params.linear_frozen
        weights = sum(params.linear_sizes)
        biases = params.linear_frozen - weights  # stay in the compute dtype
        if per_weight is None:
            linear = params.linear_frozen * w_bytes
        elif self.quantization == "int8":
            linear = weights + 4 * params.linear_rows + biases * w_bytes
        elif params.linear_sizes:
            linear = sum(_nf4_tensor_bytes(n, self.double_quant) for n in params.linear_sizes) + biases * w_bytes
        else:
            linear = params.linear_frozen * per_weight
        layers = max(params.layers, 1)
        root = other - layers * params.layer_other  # embeddings, LM head, final norm
        layer = linear / layers + params.layer_other * w_bytes
        return {"total": linear + other * w_bytes, "layer": layer, "root": root * w_bytes,
                "embedding": params.embedding * w_bytes, "head": params.output_embedding * w_bytes}

    def persistent_bytes(self, params: Any, w_bytes: int) -> int:
        """ZeRO-3's persistent parameters (whole on every rank): those of at most param_persistence_threshold
        elements, in ``named_parameters`` order while the running total stays within model_persistence_threshold
        (``DeepSpeedZeRoOffload.mark_persistent_parameters``)."""
        if self.sharding != "zero3":
            return 0
        total = 0
        for n in getattr(params, "frozen_sizes", ()):
            if n + total > self.ds.model_persistence_threshold:
                continue
            if n <= self.ds.param_persistence_threshold:
                total += n
        return total * w_bytes

    def gpu_weights(self, params: Any, w_bytes: int, world_size: int) -> int:
        """The frozen base resident on one GPU between gathers."""
        total = self.base_bytes(params, w_bytes)["total"]
        if self.sharding == "zero3":
            persistent = self.persistent_bytes(params, w_bytes)
            # every parameter keeps its partition (ds_tensor: off the GPU with offload, but a persistent one's stays);
            # a persistent one is also whole once gathered (at world size 1 the partition is the whole)
            shards = (0 if self.offload_base else (total - persistent) / world_size) + persistent / world_size
            return int(shards + (persistent if world_size > 1 else 0))
        if self.offload_base:
            return 0
        return int(total / world_size) if self.sharded else int(total)

    def grad_bucket_bytes(self, act: int) -> int:
        """DeepSpeed's contiguous gradient bucket(s): ``reduce_bucket_size`` elements in the communication dtype
        (ZeRO-3: allocated at optimizer init; ZeRO-2: at the first backward, twice with overlap_comm)."""
        if not self.deepspeed or not self.ds.contiguous_gradients:
            return 0
        comm = self.ds.communication_bytes or act
        if self.sharding == "zero3":
            return self.ds.reduce_bucket_size * comm
        return self.ds.reduce_bucket_size * comm * (2 if self.ds.overlap_comm else 1)

    def gathered(self, params: Any, w_bytes: int, world_size: int, hidden: int, phase: str,
                 checkpointing: bool = True) -> int:
        """Unsharded copies alive at once while the base runs (0 when nothing is sharded)."""
        if not self.sharded or phase == "optimizer":
            return 0
        b = self.base_bytes(params, w_bytes)
        staging = b["layer"] / world_size if self.offload_base and world_size > 1 else 0
        if self.sharding == "fsdp2":
            # A group's all-gather buffer lives until the next group's copy-out (FSDP2's all_gather_state),
            # so the first layer's gather overlaps the root's buffer: 2 roots + a layer, else root + 2 layers.
            # The LoRA weights of a layer (fp32) are gathered with it.
            layer = b["layer"] + 4 * params.trainable / max(params.layers, 1)
            return int(max(2 * b["root"] + layer, b["root"] + 2 * layer) + (b["layer"] / world_size
                                                                             if self.offload_base else 0))
        if world_size == 1 and not self.offload_base:
            return 0  # DeepSpeed's single-rank "gather" is a view of the local partition (_no_gather_coalesced)
        persistent = self.persistent_bytes(params, w_bytes)
        whole = b["total"] - persistent
        head = max(b["embedding"], b["head"])
        if phase == "generation":
            if self.gather_for_generation:
                return int(whole + staging)  # GatheredParameters(model.parameters()) around generate
            # complete trace: the running module, the prefetch, a tied embedding kept until the LM head
            tied = b["head"] == 0 and b["embedding"] > 0
            decoder = b["total"] - b["root"]
            kept = b["embedding"] if tied and decoder / w_bytes < self.ds.max_reuse_distance else 0
            module = max(b["layer"], head)
            live = (kept + module) / w_bytes
            prefetch = max(0.0, min(self.ds.prefetch_bucket_size, self.ds.max_live_parameters - live)) * w_bytes
            return int(kept + module + min(prefetch, whole) + staging)
        if checkpointing:
            # recompute attribution holds every layer's frozen weights until the backward ends, + the LM head
            return int(max(b["layer"], b["total"] - b["root"]) + head + staging)
        return int(max(b["layer"], head) + staging)

    def dequant_transient(self, params: Any, act: int) -> int:
        """bitsandbytes dequantizes one Linear's weight to the compute dtype per matmul (forward and backward)."""
        return 0 if self.quantization is None else params.largest_linear * act

    # ------------------------------------------------------------------------------- cost

    def round_cost(self, params: Any, w_bytes: int, world_size: int, *, base_forwards: int,
                   generation_forwards: int, act: int) -> RoundCost:
        """What this layout moves per generation round beyond keeping the base resident.

        ``base_forwards``: passes over the base in training (forward, backward, reference forward);
        ``generation_forwards``: prefill + one per decoding step.
        """
        total = self.base_bytes(params, w_bytes)["total"]
        link = host = 0.0
        if self.sharded:
            passes = base_forwards
            passes += 1 if (self.sharding == "zero3" and self.gather_for_generation) else generation_forwards
            link = passes * total * (world_size - 1) / world_size
            if self.offload_base:
                host = passes * total / world_size
        dequant = 0.0
        if self.quantization is not None:  # write + read a compute-dtype copy of every Linear per pass
            dequant = (base_forwards + generation_forwards) * 2 * params.linear_frozen * act
        return RoundCost(gather_bytes=link, host_bytes=host, dequant_bytes=dequant)


@dataclasses.dataclass(frozen=True)
class RoundCost:
    """Bytes moved per generation round by the layout (the LoRA gradient all-reduce, equal for every
    layout, is left out), turned into seconds with stated bandwidths."""

    gather_bytes: float = 0.0  # all-gathers received by one rank over the GPU interconnect
    host_bytes: float = 0.0  # host -> GPU copies of offloaded shards
    dequant_bytes: float = 0.0  # HBM traffic of bitsandbytes' dequantization
    recompute_flops: float = 0.0  # gradient checkpointing's second forward
    idle_flops: float = 0.0  # a layer split's stages in turn: the arithmetic the other GPUs wait through
    boundary_bytes: float = 0.0  # a layer split's hidden states (and their gradients) between GPUs
    fixed_seconds: float = 0.0  # a layer split's per-hop latency

    def seconds(self, *, link_gbps: float, host_gbps: float, hbm_gbps: float, tflops: float) -> float:
        return ((self.gather_bytes + self.boundary_bytes) / (link_gbps * 1e9) + self.host_bytes / (host_gbps * 1e9)
                + self.dequant_bytes / (hbm_gbps * 1e9) + (self.recompute_flops + self.idle_flops) / (tflops * 1e12)
                + self.fixed_seconds)


def layout_from_environment(environ: Any = None) -> dict[str, Any]:
    """``sharding`` and ``offload_base`` from the variables ``accelerate launch`` sets for its config
    (ACCELERATE_USE_FSDP + FSDP_VERSION + FSDP_OFFLOAD_PARAMS; ACCELERATE_USE_DEEPSPEED +
    ACCELERATE_DEEPSPEED_ZERO_STAGE + ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE); ddp otherwise.
    FSDP1 and ZeRO stages 0/1 are reported as the nearest modelled layout (fsdp2 / ddp)."""
    import os

    env = os.environ if environ is None else environ
    on = lambda name: str(env.get(name, "false")).lower() in ("1", "true", "yes")  # noqa: E731
    if on("ACCELERATE_USE_DEEPSPEED"):
        stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2") or 2)
        sharding = "zero3" if stage == 3 else ("zero2" if stage == 2 else "ddp")
        offload = sharding == "zero3" and env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") == "cpu"
        return {"sharding": sharding, "offload_base": offload}
    if on("ACCELERATE_USE_FSDP"):
        return {"sharding": "fsdp2", "offload_base": on("FSDP_OFFLOAD_PARAMS")}
    return {"sharding": "ddp", "offload_base": False}


def resolve_layout(sharding: str, *, quantization: str | None, double_quant: bool, offload_base: bool | None,
                   deepspeed_config: Any, hidden_size: int, gather_for_generation: bool) -> Layout:
    """The layout preflight's arguments describe: ``sharding="auto"`` and ``offload_base=None`` read
    accelerate's environment, ZeRO reads ``deepspeed_config`` (default: accelerate's
    ``ACCELERATE_DEEPSPEED_CONFIG_FILE``), and a ZeRO-3 config that offloads parameters offloads the base."""
    import os

    if sharding == "auto":
        detected = layout_from_environment()
        sharding = detected["sharding"]
        offload_base = detected["offload_base"] if offload_base is None else offload_base
    if deepspeed_config is None and sharding.startswith("zero"):
        deepspeed_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    ds = DeepSpeedSettings.from_config(deepspeed_config, hidden_size)
    if offload_base is None and sharding == "zero3" and ds.offload_param in ("cpu", "nvme"):
        offload_base = True
    return Layout(sharding=sharding, quantization=quantization, double_quant=double_quant,
                  offload_base=bool(offload_base), gather_for_generation=gather_for_generation, ds=ds)
