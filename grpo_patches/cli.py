"""``grpo-patches`` command line. Subcommands register themselves in :func:`build_parser`.

``grpo-patches doctor`` runs :func:`grpo_patches.preflight.preflight` and prints the component x rank
memory table; it exits 1 when the run would fail (a group split across ranks, a predicted peak over
``--gpu-memory-gb``), so it can gate a launch script: ``grpo-patches doctor ... && accelerate launch``.
``--plan`` tries every layout (:mod:`grpo_patches.preflight.plan`) and exits 1 when none fits; ``--tune``
every micro-batch x generation batch at the user's completions per step (:mod:`grpo_patches.preflight.tune`),
the same. Bad
input (a misspelt flag or ``--set`` name, a bad value) exits 2 with the command's own usage and the
closest valid names. ``--json`` prints the same report as one JSON object for other tools.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def _key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def _add_doctor(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="predict per-GPU memory and check the GRPO shape before a run",
        description="Predict each rank's peak memory for GRPO + LoRA on the meta device (no weights loaded) and "
        "check the rank-local group rule. Exits 1 if the run would not fit or would split groups.",
    )
    p.add_argument("--model",
                   help="the policy: a Hub model id (e.g. Qwen/Qwen2.5-0.5B-Instruct: its config.json only, never the "
                   "weights), a config.json path, a folder holding one, or a preset (llama-3.1-70b, llama-3.1-8b, "
                   "qwen2-1.5b, qwen2.5-0.5b)")
    p.add_argument("--grpo-config", type=Path, help="JSON file of GRPO settings (GRPOConfig field names)")
    p.add_argument("--set", dest="settings", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="a GRPO setting, e.g. --set per_device_train_batch_size=2 (repeatable; wins over --grpo-config)")
    p.add_argument("--lora", dest="lora", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="a LoRA setting over the pinned ones, e.g. --lora r=32 (repeatable)")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GiB (e.g. 24 for an RTX 3090)")
    p.add_argument("--reward-model", action="append", default=[], metavar="CONFIG",
                   help="a reward model: Hub id, config.json, folder or preset (repeatable)")
    p.add_argument("--reward-dtype", default="bfloat16", help="reward models' dtype (default bfloat16)")
    p.add_argument("--reward-placement", choices=("local", "main"), default="local",
                   help="reward models on every rank (local) or on rank 0 only (main)")
    p.add_argument("--dataset-size", type=int, help="number of training prompts (under 1000 gets a warning: GRPO learns little from so few)")
    p.add_argument("--prompt-length", type=int, help="prompt tokens (default: max_prompt_length or 256)")
    p.add_argument("--dtype", help="dtype of the frozen policy weights (default: bf16 when bf16 is on)")
    p.add_argument("--logits-mode", choices=("auto", "fused", "full"), default="auto",
                   help="how the trainer computes log-probs: TRL's fused LM head or full logits (default: detect)")
    p.add_argument("--fast-generation", action="store_true",
                   help="the run uses apply(fast_generation=True): its static KV cache and merged-LoRA buffer are counted while sampling")
    p.add_argument("--lean-lora", action="store_true",
                   help="the run uses apply(lean_lora=True): no fp32 copy of the LoRA layers' inputs in the training forward")
    p.add_argument("--compile-training", action="store_true",
                   help="the run uses apply(compile_training=True): its compiled layers' training memory is counted")
    p.add_argument("--speed", action="store_true",
                   help="the run uses apply(speed=True): --fast-generation --lean-lora --compile-training")
    p.add_argument("--sharding", choices=("ddp", "zero2", "fsdp2", "zero3"), default="ddp",
                   help="how the frozen base is placed over the ranks (default ddp: a full copy per rank)")
    p.add_argument("--quantization", choices=("nf4", "int8"), help="a bitsandbytes base (QLoRA); nf4 uses double quantization")
    p.add_argument("--no-double-quant", dest="double_quant", action="store_false", help="nf4 without double quantization")
    p.add_argument("--offload-base", action="store_true", help="frozen shards in host memory (fsdp2 / zero3)")
    p.add_argument("--deepspeed-config", type=Path, default=None,
                   help="DeepSpeed config JSON (ZeRO bucket / prefetch / persistence sizes; default: DeepSpeed's)")
    p.add_argument("--json", action="store_true",
                   help="print the report as one JSON object (bytes as integers); with --plan, every combination "
                   "with its launch, cost per round and memory per GPU")
    p.add_argument("--plan", action="store_true",
                   help="try every sharding x base precision x offload x checkpointing x reward placement, print those "
                   "that fit, cheapest first; exit 1 when none fits")
    p.add_argument("--tune", action="store_true",
                   help="keep the completions per optimizer step (per_device_train_batch_size x "
                   "gradient_accumulation_steps x world size) and try every micro-batch x generation batch that holds "
                   "whole groups; print each with its memory and pick the largest micro-batch that fits with 2 GiB "
                   "free, then the largest generation batch; exit 1 when none fits")
    p.add_argument("--allow-sample-ahead", action="store_true",
                   help="--tune may also sample ahead of the optimizer (steps_per_generation 2x or 4x "
                   "gradient_accumulation_steps), at the cost of a no-grad forward per micro-batch for the old log-probs")
    for name, default, what in (("link-gbps", 10.0, "GPU interconnect GB/s per GPU"),
                                ("host-gbps", 10.0, "host->GPU GB/s per GPU"),
                                ("hbm-gbps", 900.0, "GPU memory GB/s"), ("tflops", 70.0, "GPU bf16 TFLOPS")):
        p.add_argument(f"--{name}", type=float, default=default, help=f"--plan cost model: {what} (default {default:g})")
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    if args.model is None:
        args.parser.print_help()
        raise ValueError("give the policy with --model: a Hub model id, a config.json path or folder, or a preset.")
    for flag in ("plan", "tune"):
        if getattr(args, flag) and args.gpu_memory_gb is None:
            raise ValueError(f"--{flag} needs --gpu-memory-gb (memory per GPU in GiB).")
    if args.speed:  # apply(speed=True)'s options that change the memory counted (not compile_reward_models)
        args.fast_generation = args.lean_lora = args.compile_training = True
    from grpo_patches.defaults import lora_config
    from grpo_patches.preflight import RewardModelSpec, preflight

    settings: dict[str, Any] = {}
    if args.grpo_config is not None:
        settings.update(json.loads(args.grpo_config.read_text()))
    settings.update(dict(args.settings))
    lora = lora_config(**dict(args.lora)) if args.lora else None
    rewards = [RewardModelSpec(config=c, dtype=args.reward_dtype) for c in args.reward_model]
    if args.tune:
        from grpo_patches.preflight.tune import tune

        tuning = tune(args.model, gpu_memory_gb=args.gpu_memory_gb, grpo_config=settings or None,
                      world_size=args.world_size, allow_sample_ahead=args.allow_sample_ahead, lora_config=lora,
                      reward_models=rewards, reward_placement=args.reward_placement, prompt_length=args.prompt_length,
                      dtype=args.dtype, logits_mode=args.logits_mode, fast_generation=args.fast_generation,
                      lean_lora=args.lean_lora, compile_training=args.compile_training, sharding=args.sharding,
                      quantization=args.quantization,
                      double_quant=args.double_quant, offload_base=args.offload_base or None,
                      deepspeed_config=args.deepspeed_config)
        print(json.dumps(tuning.to_dict(), indent=1) if args.json else tuning)
        return 0 if tuning.best is not None else 1
    if args.plan:
        from grpo_patches.preflight.plan import CostModel, plan

        result = plan(args.model, grpo_config=settings or None, lora_config=lora, world_size=args.world_size,
                      gpu_memory_gb=args.gpu_memory_gb, reward_models=rewards, dataset_size=args.dataset_size,
                      prompt_length=args.prompt_length, dtype=args.dtype, logits_mode=args.logits_mode,
                      fast_generation=args.fast_generation, lean_lora=args.lean_lora,
                      compile_training=args.compile_training, deepspeed_config=args.deepspeed_config,
                      cost_model=CostModel(args.link_gbps, args.host_gbps, args.hbm_gbps, args.tflops))
        print(json.dumps(result.to_dict(), indent=1) if args.json else result)
        return 0 if result.best is not None else 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report prints its warnings itself
        report = preflight(
            args.model,
            grpo_config=settings or None,
            lora_config=lora,
            world_size=args.world_size,
            gpu_memory_gb=args.gpu_memory_gb,
            reward_models=rewards,
            reward_placement=args.reward_placement,
            dataset_size=args.dataset_size,
            prompt_length=args.prompt_length,
            dtype=args.dtype,
            logits_mode=args.logits_mode,
            fast_generation=args.fast_generation,
            lean_lora=args.lean_lora,
            compile_training=args.compile_training,
            sharding=args.sharding,
            quantization=args.quantization,
            double_quant=args.double_quant,
            offload_base=args.offload_base or None,
            deepspeed_config=args.deepspeed_config,
            raise_on_error=False,
            warn=False,
        )
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 1 if report.errors else 0


def versions_table() -> str:
    """The README's supported-versions table, from compat.json and the adapters (never hand-edited)."""
    from . import compat, registry

    adapters = {a.key: a for a in registry.ADAPTERS}
    free = set(compat.table().get("grpo_free", []))
    rows = ["| TRL | transformers | accelerate | peft | datasets | status |", "|---|---|---|---|---|---|"]
    for release, row in sorted(compat.table()["supported"].items(), key=lambda kv: compat._key(kv[0])):
        if release in free:
            status = "needs no patch (groups already rank-local)"
        elif row["era"] in adapters:
            status = f"patched (adapter `{row['era']}`)"
        else:
            status = f"refused: era `{row['era']}` has no adapter yet"
        rows.append(f"| {release} | {row['transformers']} | {row['accelerate']} | {row['peft']} | "
                    f"{row['datasets']} | {status} |")
    return "\n".join(rows)


def versions_rows() -> list[dict[str, str]]:
    """The supported-versions table as rows (``grpo-patches versions --json``)."""
    from . import compat, registry

    adapters = {a.key for a in registry.ADAPTERS}
    free = set(compat.table().get("grpo_free", []))
    rows = []
    for release, row in sorted(compat.table()["supported"].items(), key=lambda kv: compat._key(kv[0])):
        status = "needs-no-patch" if release in free else "patched" if row["era"] in adapters else "refused"
        rows.append({"trl": release, **{k: row[k] for k in ("transformers", "accelerate", "peft", "datasets")},
                     "era": row["era"], "status": status})
    return rows


def _add_versions(sub: Any) -> None:
    p = sub.add_parser("versions", help="print the supported-versions table (markdown; --json for rows)",
                       description="The TRL releases the kit supports, each with its tested dependency set.")
    p.add_argument("--json", action="store_true", help="one JSON list of rows instead of the markdown table")
    p.set_defaults(func=lambda args: print(json.dumps(versions_rows(), indent=1) if args.json else versions_table())
                   or 0)


class _Parser(argparse.ArgumentParser):
    """argparse with the closest valid names in its errors ("did you mean --world-size?")."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice and "did you mean" not in message and "maybe you meant" not in message:
            valid = re.findall(r"'([^']*)'", choice.group(2)) or [c.strip() for c in choice.group(2).split(",")]
            close = difflib.get_close_matches(choice.group(1), valid, n=2)
            if close:
                message += f"; did you mean {' or '.join(close)}?"
        super().error(message)

    def unrecognized(self, extras: list[str]) -> None:
        """Refuse unknown arguments with this (sub)command's usage and the closest option names."""
        options = [o for a in self._actions for o in a.option_strings]
        hints = []
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=", 1)[0], options, n=2) if extra.startswith("-") else []
            if close:
                hints.append(f"{extra}: did you mean {' or '.join(close)}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _version() -> str:
    from importlib import metadata

    from .surface import VERSION

    try:
        trl = f"TRL {metadata.version('trl')} installed"
    except metadata.PackageNotFoundError:
        trl = "TRL not installed"
    return f"grpo-patches {VERSION} ({trl})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpo-patches", description="Patch kit for multi-GPU GRPO with LoRA.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_doctor(sub)
    _add_versions(sub)
    from .fork.commands import add_subcommands as _add_patch_commands

    _add_patch_commands(sub)  # make-patches, check-patches, edit-groups
    for name, command in sub.choices.items():
        command.set_defaults(parser=command)
        command.prog = f"grpo-patches {name}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry: ``grpo-patches COMMAND ...``; returns the exit status."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extras:
        args.parser.unrecognized(extras)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad input: one line, not a traceback
        print(f"grpo-patches {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
