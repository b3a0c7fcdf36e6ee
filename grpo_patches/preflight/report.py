"""What a preflight hands back and how it prints: per-rank estimates, the report, the component x rank table.

The last stage of the pipeline (see :mod:`grpo_patches.preflight`): it computes no memory, it holds and
formats what :mod:`.estimate` and :mod:`.advise` found.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_patches.preflight.count import ParamCount

__all__ = ["GiB", "PreflightError", "PreflightReport", "PreflightWarning", "RankEstimate", "gib", "render_table"]

GiB = 2**30


class PreflightWarning(UserWarning):
    """A setting that will run but is not advised (trainable share, memory headroom, data and rewards)."""


class PreflightError(ValueError):
    """The predicted peak exceeds the memory given; the message lists settings that fit."""



@dataclasses.dataclass
class RankEstimate:
    """One rank's predicted memory: bytes per component, per phase, the peak and whether it fits."""

    rank: int
    components: dict[str, int]
    phases: dict[str, int]
    capacity: int | None = None
    overhead: int = 0
    fragmentation: float = 0.0

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def required(self) -> int:
        """Peak plus allocator slack and the memory torch does not count (CUDA context)."""
        return int(self.peak * (1 + self.fragmentation)) + self.overhead

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.required <= self.capacity

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.required

    def __str__(self) -> str:
        return render_table([self], title=f"rank {self.rank}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, bytes as integers (``grpo-patches doctor --json``)."""
        return {"rank": self.rank, "components": dict(self.components), "phases": dict(self.phases),
                "peak": self.peak, "peak_phase": self.peak_phase, "required": self.required,
                "capacity": self.capacity, "fits": self.fits}


@dataclasses.dataclass
class PreflightReport:
    """Everything the preflight found: per-rank estimates, parameter counts, errors and warnings."""

    ranks: list[RankEstimate]
    params: ParamCount
    settings: dict[str, Any]
    activations_checkpointed: int
    activations_full: int
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        flags = [r.fits for r in self.ranks]
        return None if any(f is None for f in flags) else all(flags)

    @property
    def ok(self) -> bool:
        return not self.errors

    def table(self) -> str:
        return render_table(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, bytes as integers (``grpo-patches doctor --json``): what the table and the
        lines around it say, for other tools to read."""
        return {
            "ok": self.ok, "fits": self.fits, "peak": self.peak,
            "params": {"total": self.params.total, "trainable": self.params.trainable, "share": self.params.share},
            "settings": {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                         for k, v in self.settings.items()},
            "activations": {"checkpointed": self.activations_checkpointed, "full": self.activations_full},
            "ranks": [r.to_dict() for r in self.ranks],
            "errors": list(self.errors), "warnings": list(self.warnings),
        }

    def __str__(self) -> str:
        s = self.settings
        lines = [
            f"policy: {_count(self.params.total)} params, trainable {self.params.trainable / 1e6:.2f}M "
            f"({100 * self.params.share:.3f}%); weights {s['dtype']}, compute {s['compute_dtype']}",
            f"shape: world_size={s['world_size']} per_device_train_batch_size={s['per_device_train_batch_size']} "
            f"steps_per_generation={s['steps_per_generation']} num_generations={s['num_generations']} "
            f"prompt={s['prompt_length']} completion={s['completion_length']} tokens; "
            f"gradient_checkpointing={s['gradient_checkpointing']}; logits={s['logits_mode']}; "
            f"rewards={s['reward_placement']}; layout={s['layout']}"
            + (f" (host memory per rank: {s['host_weights_gb']:.2f} GiB of frozen shards)" if s["host_weights_gb"] else ""),
            self.table(),
            f"activations: {gib(self.activations_checkpointed)} with gradient checkpointing, "
            f"{gib(self.activations_full)} without (per rank)",
        ]
        lines += [f"ERROR: {e}" for e in self.errors]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ table


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def gib(n: int | float) -> str:
    if abs(n) >= GiB // 2 or n == 0:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if abs(n) >= 2**19 else f"{n / 2**10:.2f} KiB"


_ROWS = ("weights", "gathered_weights", "grad_bucket", "dequant_transient", "lora_params", "lora_grads", "optimizer_state", "activations", "logits_logps", "autocast_cache",
         "kv_cache", "generation_transient", "decode_graph", "reward_weights", "reward_scoring")


def _unit(peak: int) -> tuple[str, int]:
    """The table's unit: GiB, or MiB / KiB where the peak is under half of the larger unit (tiny models)."""
    for name, size in (("GiB", GiB), ("MiB", 2**20)):
        if peak >= size // 2:
            return name, size
    return "KiB", 2**10


def render_table(ranks: list[RankEstimate], title: str | None = None) -> str:
    """Component x rank table in GiB (MiB / KiB for small runs); ranks with identical figures share a
    column; a component that is 0 on every rank (no reward model, no offload, ...) is left out."""
    groups: list[list[RankEstimate]] = []
    for r in ranks:
        if groups and groups[-1][0].components == r.components and groups[-1][0].phases == r.phases:
            groups[-1].append(r)
        else:
            groups.append([r])
    unit, size = _unit(max(max(g[0].peak, g[0].capacity or 0) for g in groups))
    heads = [title or (f"rank {g[0].rank}" if len(g) == 1 else f"ranks {g[0].rank}-{g[-1].rank}") for g in groups]
    rows: list[tuple[str, list[str]]] = []
    for name in _ROWS:
        if not any(g[0].components.get(name, 0) for g in groups):
            continue
        rows.append((name, [f"{g[0].components.get(name, 0) / size:.2f}" for g in groups]))
    for phase in ("generation", "scoring", "training", "optimizer"):
        rows.append((f"= {phase}", [f"{g[0].phases[phase] / size:.2f}" for g in groups]))
    rows.append(("peak", [f"{g[0].peak / size:.2f} ({g[0].peak_phase})" for g in groups]))
    if any(g[0].capacity is not None for g in groups):
        rows.append(("needed (+overhead)", [f"{g[0].required / size:.2f}" for g in groups]))
        rows.append(("capacity", [f"{(g[0].capacity or 0) / size:.2f}" for g in groups]))
        rows.append(("fits", ["yes" if g[0].fits else "NO" for g in groups]))
    width0 = max(len(r[0]) for r in rows) + 2
    widths = [max(len(h), *(len(r[1][i]) for r in rows)) + 2 for i, h in enumerate(heads)]
    out = [unit.ljust(width0) + "".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    for name, cells in rows:
        out.append(name.ljust(width0) + "".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(out)
