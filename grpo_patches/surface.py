"""What the public face declares: the kit's version and :func:`grpo_patches.apply`'s options.

One place for each option's name, default and help text, read by ``apply()``'s docstring and by the
fork patch writer (:mod:`grpo_patches.fork`), which turns the options as ``GRPOConfig`` fields with
the same names, defaults and help. Imports nothing: the face and the writer both sit above it.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

__all__ = ["OPTIONS", "VERSION", "Option", "args_section"]

VERSION = "0.1.0"


@dataclass(frozen=True)
class Option:
    """One keyword of ``apply()``: its default, its type as a dataclass field would spell it, its help."""

    name: str
    default: object
    annotation: str
    help: str
    fork_help: str = ""  # the GRPOConfig field's help in a patched fork, where it differs from apply()'s


OPTIONS: tuple[Option, ...] = (
    Option("reward_placement", "local", "str",
           '``"local"`` (each rank scores its own whole groups) or ``"main"`` (reward models and functions run '
           "on the main process only)."),
    Option("reward_chunk_size", None, "int | None",
           "most completions scored in one call; a multiple of ``num_generations`` (checked when the trainer is "
           "built). ``None``: one call per rank / per step."),
    Option("reward_timeout", 600.0, "float",
           "seconds a step's reward computation may take before every rank raises."),
    Option("reward_failure", "raise", "str",
           'what a reward call that raises or times out does: ``"raise"`` (every rank raises, naming the rank, '
           'the function and the error), ``"no_reward"`` (that function gives the call\'s completions no reward, '
           'as if it returned ``None``) or ``"drop_group"`` (the call\'s groups get no reward from any function, so '
           "no advantage). Every rank goes on alike; the step's count is logged as ``rewards/failed_calls``. A "
           "timed-out step gives all of its rows no reward; code holding the GIL past the deadline still ends its "
           "process."),
    Option("strict", True, "bool",
           "on a TRL release outside the tested range raise :class:`UnsupportedVersionError`; with ``False``, "
           "warn and patch nothing."),
    Option("fast_generation", None, "bool | None",
           "compiled decoding under a static KV cache with dropout off while sampling (``True``, a dict of "
           ":class:`~grpo_patches.generation.FastGenerationConfig` fields, or such a config); on CPU it warns "
           "once and samples eagerly. ``None``: as ``speed``.",
           "``True``: compiled decoding under a static KV cache with dropout off while sampling, with its default "
           "settings (TRL 0.29+; the dict / config forms of ``apply()`` are not offered here); on CPU it warns "
           "once and samples eagerly. ``None`` or ``False``: off."),
    Option("lean_lora", None, "bool | None",
           "under bf16 / fp16 autocast, the policy's LoRA layers run their dropout and adapter on the input as "
           "it is, skipping PEFT's fp32 copy (autocast rounds the adapter's input back anyway, so values are "
           "unchanged; dropout masks are drawn by another kernel). Saves memory traffic and transient memory in "
           "every training forward and backward. ``None``: as ``speed``; needs peft >= 0.15.",
           "under bf16 / fp16 autocast, the policy's LoRA layers skip PEFT's fp32 copy of their input (values "
           "unchanged; dropout masks drawn by another kernel); needs peft >= 0.15. ``None`` or ``False``: off."),
    Option("compile_training", None, "bool | None",
           "the policy's decoder layers run compiled (inductor) whenever autograd is on (the training forward "
           "and its recomputation), eager otherwise (sampling). Fewer, fused kernels; not bit-identical to eager "
           "(rounding, dropout masks); the first steps compile. One process or DDP. ``None``: as ``speed``.",
           "the policy's decoder layers run compiled (inductor) whenever autograd is on, eager otherwise "
           "(sampling); not bit-identical to eager; the first steps compile. One process or DDP. ``None`` or "
           "``False``: off."),
    Option("compile_reward_models", None, "bool | None",
           "the reward models' decoder layers run compiled (inductor) when they score (no autograd), one graph "
           "for every layer and length; their ``config.use_cache`` is set to ``False``. Fewer, fused kernels; "
           "scores not bit-identical to eager (rounding); the first scoring compiles. One process or DDP. "
           "``None``: as ``speed``.",
           "the reward models' decoder layers run compiled (inductor) when they score; scores not bit-identical "
           "to eager; the first scoring compiles. One process or DDP. ``None`` or ``False``: off."),
    Option("freeze_gc", None, "bool | None",
           "after the first optimizer step, a full collection and ``gc.freeze()``: Python's collector no longer "
           "walks what that step built (compiled graphs and their guards), whose full collections took up to a "
           "second on a compiled run; ``gc.unfreeze()`` when ``train()`` returns or raises (unless the process "
           "had frozen objects before). ``None``: as ``speed``.",
           "after the first optimizer step, a full collection and ``gc.freeze()`` (Python's collector no longer "
           "walks what that step built); ``gc.unfreeze()`` when ``train()`` returns or raises. ``None`` or "
           "``False``: off."),
    Option("overlap_micro_batches", None, "bool | None",
           "while ``train()`` runs, no host read of a device value between a micro-batch's backward and the next "
           "forward, so the host queues the next micro-batch while the device runs this one: the Trainer's NaN / "
           "inf filter of the logged loss runs on the device (the same logged loss), and the training forward's "
           "SDPA mask takes its \"no padding\" answer from the host, read once per generation batch. Where the "
           "Trainer or transformers makes no such read, nothing changes. ``None``: as ``speed``.",
           "while ``train()`` runs, no host read of a device value between micro-batches (the logged loss's NaN / "
           "inf filter on the device, the SDPA mask's padding test answered by the host); the same logged loss. "
           "``None`` or ``False``: off."),
    Option("speed", False, "bool",
           "the GPU path measured fastest at every batch tried: ``fast_generation``, ``lean_lora``, "
           "``compile_training``, ``compile_reward_models``, ``freeze_gc`` and ``overlap_micro_batches`` on, each "
           "still set by its own option "
           "when given (``speed=True, compile_training=False`` keeps stock's training numerics). Refused, naming "
           "the option, where one of them cannot apply. Off by default: it changes what is sampled and the "
           "training numerics."),
    Option("targets", ("trl", "vendored"), "tuple[str, ...]",
           'which trainers to patch: ``"trl"`` (``trl.GRPOTrainer``) and/or ``"vendored"`` (the vendored '
           "DeepSeekMath-style trainer). Both by default, and then only if the installed TRL is patched; "
           '``("vendored",)`` patches the vendored trainer alone and needs no TRL.'),
)


def args_section(indent: str = "    ") -> str:
    """The ``Args:`` section of ``apply()``'s docstring, at the docstring's own indentation."""
    lines = [f"{indent}Args:"]
    for option in OPTIONS:
        lines += textwrap.wrap(f"{option.name}: {option.help}", 96, initial_indent=indent * 2,
                               subsequent_indent=indent * 3)
    return "\n".join(lines) + "\n"
