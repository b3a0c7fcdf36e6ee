"""Prints, as JSON, what a patched TRL offers: its GRPOConfig settings, parsed and defaulted, which
GRPOTrainer methods carry the kit's wrappers, and how a bad setting is refused. Fork mode only."""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.py
import helpers  # noqa: E402

helpers.quiet()


def main() -> None:
    from transformers import HfArgumentParser
    from trl import GRPOConfig, GRPOTrainer

    out_dir = tempfile.mkdtemp()
    names = ("grpo_patches", "reward_placement", "reward_chunk_size", "reward_timeout", "fast_generation")
    default = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False)
    (parsed,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", out_dir, "--use_cpu", "true", "--bf16", "false", "--reward_placement", "main", "--reward_chunk_size", "8", "--reward_timeout", "30",
         "--grpo_patches", "false"])
    out = {
        "kit_importable": importlib.util.find_spec("grpo_patches") is not None,
        "defaults": {n: getattr(default, n) for n in names},
        "parsed": {n: getattr(parsed, n) for n in names},
        "wrapped": sorted(n for n, v in vars(GRPOTrainer).items() if hasattr(v, "_self_wrapper")),
    }
    try:
        GRPOTrainer(model=helpers.tiny_policy(), reward_funcs=[helpers.target_share],
                    args=helpers.grpo_args(reward_placement="nowhere"), train_dataset=helpers.prompt_dataset(8),
                    processing_class=helpers.tiny_tokenizer(), peft_config=helpers.lora())
        out["bad_setting"] = None
    except ValueError as exc:
        out["bad_setting"] = str(exc)
    try:  # fast generation needs _generate_single_turn (TRL 0.29+); in a fork it must not need wrapt
        trainer = GRPOTrainer(model=helpers.tiny_policy(), reward_funcs=[helpers.target_share],
                              args=helpers.grpo_args(fast_generation=True), train_dataset=helpers.prompt_dataset(8),
                              processing_class=helpers.tiny_tokenizer(), peft_config=helpers.lora())
        out["fast_generation"] = hasattr(trainer, "_grpo_patches_fast_generation")
    except ValueError as exc:
        out["fast_generation"] = str(exc)
    out["wrapt_imported"] = "wrapt" in sys.modules
    print(json.dumps(out))


if __name__ == "__main__":
    main()
