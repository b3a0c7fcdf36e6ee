"""Test helpers: the tiny components (grpo_patches/testing.py, loaded without the kit: tests/kitfree.py), TRL configs and trainers for CPU tests, rewards."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

try:
    from tests.kitfree import testing
except ModuleNotFoundError:  # imported as a top-level module with tests/ on sys.path (tests/fork/settings_probe.py)
    from kitfree import testing

# the tiny components, as the tests import them (grpo_patches/testing.py, without importing the kit)
PROJ, SPECIAL, WORDS = testing.PROJ, testing.SPECIAL, testing.WORDS
prompt_dataset, quiet, tiny_config = testing.prompt_dataset, testing.quiet, testing.tiny_config
tiny_policy, tiny_reward_model, tiny_tokenizer = testing.tiny_policy, testing.tiny_reward_model, testing.tiny_tokenizer
lora = testing.tiny_lora


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """Python's own Ctrl-C handler (``KeyboardInterrupt``) inside the block. A process a shell without job
    control starts in the background (``nohup pytest &``) inherits SIGINT ignored, and Python leaves it so:
    a test that presses Ctrl-C would see nothing happen."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def on_gpu() -> bool:
    """GRPO_PATCHES_TEST_DEVICE=cuda runs the multi-process tests on GPUs over NCCL (one rank per GPU)."""
    return os.environ.get("GRPO_PATCHES_TEST_DEVICE", "cpu") == "cuda"


def grpo_args(output_dir: str | None = None, **overrides: Any):
    from trl import GRPOConfig

    fields = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="grpo_test_"),
        use_cpu=not on_gpu(), bf16=False, report_to=[], save_strategy="no", logging_steps=1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=1, learning_rate=1e-3, seed=7, gradient_checkpointing=False,
        disable_tqdm=True, dataloader_num_workers=0, temperature=1.0,
    )
    fields.update(overrides)
    return GRPOConfig(**fields)


def target_share(completions, target=None, **kwargs):
    """Reward: share of the prompt's target letter among the completion's words."""
    out = []
    for i, text in enumerate(completions):
        words = text.split()
        goal = target[i] if target else "a"
        out.append(sum(w == goal for w in words) / max(len(words), 1))
    return out


def patched_trl_trainer(args: Any, *, reward_funcs: Any = target_share, **apply_kw: Any):
    """TRL's ``GRPOTrainer`` on ``tiny_policy(5)`` with the tiny LoRA and ``reward_funcs`` (the target-letter
    reward), built under ``apply(**apply_kw)`` (reverted afterwards: the options stay with the built trainer)."""
    from trl import GRPOTrainer

    import grpo_patches

    quiet()
    grpo_patches.revert()
    grpo_patches.apply(**apply_kw)
    try:
        return GRPOTrainer(model=tiny_policy(5), reward_funcs=reward_funcs, train_dataset=prompt_dataset(),
                           processing_class=tiny_tokenizer(), peft_config=lora(), args=args)
    finally:
        grpo_patches.revert()


def patched_vendored_trainer(*, reward_funcs: Any = target_share, **apply_kw: Any):
    """The vendored DeepSeekMath-style trainer on the tiny LoRA policy with ``reward_funcs`` (the target-letter
    reward), built under ``apply(targets=("vendored",), **apply_kw)`` (reverted afterwards: the options stay
    with the built trainer)."""
    import warnings

    from peft import get_peft_model

    import grpo_patches
    from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer

    grpo_patches.apply(targets=("vendored",), **apply_kw)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return DSMGRPOTrainer(get_peft_model(tiny_policy(), lora()), tiny_tokenizer(), reward_funcs,
                                  DSMGRPOConfig(max_new_tokens=4))
    finally:
        grpo_patches.revert()


def live_lora_policy(dropout: float, *, dtype: Any = None, layers: int = 2, **lora_kw: Any):
    """``tiny_policy(3)`` with an r=4 LoRA adapter on every projection whose B is random (PEFT starts it
    at zero, and an adapter that adds nothing tests nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = tiny_policy(3, num_hidden_layers=layers)
    model = get_peft_model(base.to(dtype) if dtype is not None else base,
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=PROJ, **lora_kw))
    torch.manual_seed(4)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    return model
