"""Tiny real components for tests and the demo: a Llama built from a config with random weights,
a word-level tokenizer built locally (no hub), a prompt dataset with a row id column."""

from __future__ import annotations

import os
import tempfile
from typing import Any

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the pinned LoRA targets
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "say", "the", "letter", "please", "now", "and", "or"]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_input_names=["input_ids", "attention_mask"],  # Llama rejects token_type_ids (FACTS.md)
    )


def tiny_config(kind: str = "llama", **overrides: Any):
    from transformers import LlamaConfig, Qwen2Config

    n_vocab = len(SPECIAL) + len(WORDS)
    common = dict(vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    return (Qwen2Config if kind == "qwen2" else LlamaConfig)(**common)


def tiny_policy(seed: int = 0, **overrides: Any):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def tiny_reward_model(seed: int = 1, name: str = "tiny-reward-model"):
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config(num_labels=1)
    config._name_or_path = name
    return AutoModelForSequenceClassification.from_config(config)


def prompt_dataset(n_rows: int = 16):
    from datasets import Dataset

    letters = WORDS[:8]
    rows = [{"prompt": f"say the letter {letters[i % 8]} please", "row": i, "target": letters[i % 8]}
            for i in range(n_rows)]
    return Dataset.from_list(rows)


def lora(r: int = 4):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


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


def quiet() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "datasets", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)


def patched_trl_trainer(args: Any, **apply_kw: Any):
    """TRL's ``GRPOTrainer`` on ``tiny_policy(5)`` with the tiny LoRA and the target-letter reward, built under
    ``apply(**apply_kw)`` (reverted afterwards: the options stay with the built trainer)."""
    from trl import GRPOTrainer

    import grpo_patches

    quiet()
    grpo_patches.revert()
    grpo_patches.apply(**apply_kw)
    try:
        return GRPOTrainer(model=tiny_policy(5), reward_funcs=target_share, train_dataset=prompt_dataset(),
                           processing_class=tiny_tokenizer(), peft_config=lora(), args=args)
    finally:
        grpo_patches.revert()


def patched_vendored_trainer(**apply_kw: Any):
    """The vendored DeepSeekMath-style trainer on the tiny LoRA policy, built under ``apply(targets=("vendored",),
    **apply_kw)`` (reverted afterwards: the options stay with the built trainer)."""
    import warnings

    from peft import get_peft_model

    import grpo_patches
    from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer

    grpo_patches.apply(targets=("vendored",), **apply_kw)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return DSMGRPOTrainer(get_peft_model(tiny_policy(), lora()), tiny_tokenizer(), target_share,
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
