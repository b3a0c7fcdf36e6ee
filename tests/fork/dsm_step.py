"""One step of the vendored trainer with fast generation on, in fork or monkeypatch mode; prints JSON.

    GRPO_PATCHES_KIT_MODE=fork python tests/fork/dsm_step.py DIR   # DIR holds a patched dsm_grpo.py
    GRPO_PATCHES_KIT_MODE=monkeypatch python tests/fork/dsm_step.py -   # grpo_patches.apply(fast_generation=True)
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.py
import helpers  # noqa: E402

helpers.quiet()
import torch  # noqa: E402

PROMPTS = ["say the letter a", "say a", "please say a now", "the letter a please"]
FAST_GEN_ATTR = "_grpo_patches_fast_generation"


def main() -> None:
    mode = os.environ.get("GRPO_PATCHES_KIT_MODE", "monkeypatch")
    fields = dict(num_generations=4, max_new_tokens=8, learning_rate=1e-3)
    if mode == "fork":
        sys.path.insert(0, sys.argv[1])
        from dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer
        configs = {"off": DSMGRPOConfig(**fields), "on": DSMGRPOConfig(**fields, fast_generation=True)}
    else:
        import grpo_patches
        from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer
        configs = {"off": DSMGRPOConfig(**fields), "on": DSMGRPOConfig(**fields)}
    from peft import LoraConfig, get_peft_model

    out = {"kit_importable": importlib.util.find_spec("grpo_patches") is not None}
    for label, config in configs.items():
        if mode == "monkeypatch":
            grpo_patches.apply(fast_generation=label == "on")
        model = get_peft_model(helpers.tiny_policy(0), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                                  target_modules=["q_proj", "v_proj"],
                                                                  task_type="CAUSAL_LM"))
        trainer = DSMGRPOTrainer(model, helpers.tiny_tokenizer(), helpers.target_share, config)
        torch.manual_seed(5)
        metrics = trainer.step(PROMPTS)
        state = getattr(trainer, FAST_GEN_ATTR, None)
        out[label] = {"metrics": metrics, "fast_calls": None if state is None else state.calls}
    out["wrapt_imported"] = "wrapt" in sys.modules
    print(json.dumps(out))


if __name__ == "__main__":
    main()
