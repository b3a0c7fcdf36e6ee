"""Tiny real components for demos and tests: no hub, no download, seconds on a CPU.

A Llama (or Qwen2) built from a small config with random weights, a word-level tokenizer built
locally over a 15-word vocabulary, a prompt dataset over it ("say the letter X please", with the
target letter and a row id as columns), a LoRA config for it, and a free local port for starting a
few gloo ranks. They exercise the real transformers / PEFT / TRL code paths; they learn nothing
useful. Imports nothing of the kit.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Any

__all__ = ["PROJ", "SPECIAL", "WORDS", "free_port", "prompt_dataset", "quiet", "tiny_config", "tiny_lora",
           "tiny_policy", "tiny_reward_model", "tiny_tokenizer"]

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the pinned LoRA targets
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "say", "the", "letter", "please", "now", "and", "or"]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def tiny_tokenizer() -> Any:
    """A word-level fast tokenizer over ``SPECIAL + WORDS`` (pad 0, eos 1, bos 2, unk 3), built locally."""
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
        model_input_names=["input_ids", "attention_mask"],  # LlamaForCausalLM.forward takes no token_type_ids
    )


def tiny_config(kind: str = "llama", **overrides: Any) -> Any:
    """A 2-layer, 32-wide Llama (or ``kind="qwen2"``) config over the tiny vocabulary, 4 heads on 2 K/V heads."""
    from transformers import LlamaConfig, Qwen2Config

    n_vocab = len(SPECIAL) + len(WORDS)
    common = dict(vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    return (Qwen2Config if kind == "qwen2" else LlamaConfig)(**common)


def tiny_policy(seed: int = 0, **overrides: Any) -> Any:
    """A causal LM with random weights (``seed``) from :func:`tiny_config` (``overrides`` go to it)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def tiny_reward_model(seed: int = 1, name: str = "tiny-reward-model") -> Any:
    """A sequence classifier (one label) with random weights, named ``name`` as a hub model would be."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config(num_labels=1)
    config._name_or_path = name
    return AutoModelForSequenceClassification.from_config(config)


def prompt_dataset(n_rows: int = 16) -> Any:
    """``n_rows`` prompts "say the letter X please" with columns ``row`` (its index) and ``target`` (X)."""
    from datasets import Dataset

    letters = WORDS[:8]
    rows = [{"prompt": f"say the letter {letters[i % 8]} please", "row": i, "target": letters[i % 8]}
            for i in range(n_rows)]
    return Dataset.from_list(rows)


def tiny_lora(r: int = 4) -> Any:
    """LoRA on all seven projections of the tiny model, no dropout."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def quiet() -> None:
    """Library warnings and info logs off: the output shows what the demo or test prints."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "datasets", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and outside the kernel's ephemeral range.

    ``bind(0)`` hands out an ephemeral port, which the kernel may then give to any outgoing connection
    (gloo opens many) before the world that was told to listen on it does: EADDRINUSE, seen in CI.
    Below the range only an explicit bind can take it.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        if port in _HANDED_OUT:  # free now, but promised to a world that may not listen yet
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
