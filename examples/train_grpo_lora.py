"""GRPO + LoRA on math answers with the kit: the script to copy and adapt.

    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_grpo_lora.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset-config main \\
        --prompt-column question --solution-column answer --gpu-memory-gb 24

    python examples/train_grpo_lora.py --model tiny --max-steps 2     # built-in tiny model, CPU, no download

What it does, in order: reads the dataset (a local .jsonl / .json / .csv / .parquet file, or a
``datasets`` name) into conversational prompts with a ``solution`` column; builds the pinned GRPO
settings (``grpo_patches.defaults.grpo_config``) and LoRA (``lora_config``); runs the preflight
memory check on the model's config BEFORE any weight is loaded (``--gpu-memory-gb``; exits with the
reason and the settings that would fit); ``grpo_patches.apply(...)``; loads the model; trains with
TRL's ``accuracy_reward`` (math-verify) plus a format reward (the answer in ``\\boxed{}``), the
monitor callback and ``report_to`` tensorboard; saves checkpoints every ``--save-steps`` and, with
``--resume``, continues from the newest checkpoint in ``--output-dir``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import grpo_patches  # noqa: E402
from grpo_patches.defaults import grpo_config, lora_config  # noqa: E402

SYSTEM = "Solve the problem. Put the final answer in \\boxed{}."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a model path / hub name, or 'tiny' (built-in, random weights)")
    p.add_argument("--dataset", default="builtin",
                   help="a local .jsonl/.json/.csv/.parquet file, a datasets name, or 'builtin' (generated sums)")
    p.add_argument("--dataset-config", default=None, help="the datasets config name (e.g. 'main' for gsm8k)")
    p.add_argument("--split", default="train")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--solution-column", default="solution",
                   help="the reference answer; gsm8k-style '#### 42' endings are cut to the number")
    p.add_argument("--output-dir", default="outputs/grpo", help="checkpoints, logs and the adapter (default outputs/grpo)")
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--per-device-batch", type=int, default=1)
    p.add_argument("--steps-per-generation", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--placement", default="local", choices=["local", "main"], help="where rewards run")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="preflight: GiB per GPU (default: detected)")
    p.add_argument("--report-to", default="tensorboard")
    p.add_argument("--no-ds3-gather", dest="ds3_gather", action="store_false",
                   help="ZeRO-3: generate from the partitioned model instead of gathering it whole first (slow: "
                   "every decoding step gathers every layer; for models whose whole copy does not fit one GPU)")
    p.add_argument("--fast-generation", action="store_true", help="compiled decoding (GPU, TRL >= 0.29)")
    p.add_argument("--lean-lora", action="store_true",
                   help="LoRA layers without PEFT's fp32 input copy under bf16 autocast (less memory and time)")
    p.add_argument("--compile-training", action="store_true",
                   help="decoder layers compiled for the training forward / backward (one process or DDP)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ data


def builtin_rows(n: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"What is {a} + {b}?", "solution": str(a + b)})
    return rows


def load_rows(args: argparse.Namespace):
    """A ``datasets.Dataset`` with a conversational ``prompt`` and a ``solution`` column."""
    import datasets

    if args.dataset == "builtin":
        ds = datasets.Dataset.from_list(builtin_rows())
    elif os.path.exists(args.dataset):
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}[Path(args.dataset).suffix]
        ds = datasets.load_dataset(kind, data_files=args.dataset, split="train")
    else:
        ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
    for column in (args.prompt_column, args.solution_column):
        if column not in ds.column_names and args.dataset != "builtin":
            raise SystemExit(f"train_grpo_lora: column {column!r} not in the dataset ({', '.join(ds.column_names)}); "
                             f"pass --prompt-column / --solution-column.")
    p_col, s_col = (("prompt", "solution") if args.dataset == "builtin" else (args.prompt_column, args.solution_column))

    def convert(row):
        solution = str(row[s_col]).split("####")[-1].strip()  # gsm8k: reasoning, then '#### answer'
        return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(row[p_col])}],
                "solution": f"${solution}$"}

    return ds.map(convert, remove_columns=[c for c in ds.column_names if c not in ("prompt", "solution")])


# --------------------------------------------------------------------------------------- rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1 when the completion gives its answer in \\boxed{...}, else 0."""
    return [1.0 if re.search(r"\\boxed\{[^{}]+\}", c[0]["content"]) else 0.0 for c in completions]


# ----------------------------------------------------------------------------------------- model


def tiny_model_and_tokenizer():
    """A random-init 2-layer Llama and a character-level tokenizer with a chat template: no download."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = sorted(set("0123456789+-=?.,:;!()[]{}\\$ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>",
                                        model_input_names=["input_ids", "attention_mask"])
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}Answer: {% endif %}")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return config, (lambda: LlamaForCausalLM(config)), tokenizer


def model_config_and_loader(name: str, dtype: str | None):
    """The model's config (for preflight: no weights) and a function that loads the weights."""
    if name == "tiny":
        return tiny_model_and_tokenizer()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(name)
    return config, (lambda: AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto")), \
        AutoTokenizer.from_pretrained(name)


def detected_gpu_memory_gb() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOTrainer
    from trl.rewards import accuracy_reward

    on_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = grpo_config(
        args.output_dir, max_steps=args.max_steps, save_steps=args.save_steps, save_strategy="steps",
        per_device_train_batch_size=args.per_device_batch, steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=args.steps_per_generation, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, report_to=[args.report_to] if args.report_to else [],
        logging_steps=1, use_cpu=not on_gpu,
        **({} if args.ds3_gather else {"ds3_gather_for_generation": False}),
    )
    lora = lora_config()
    model_config, load_model, tokenizer = model_config_and_loader(args.model, None)
    dataset = load_rows(args)

    # Preflight on the config alone: a run that cannot fit stops here, before a weight is loaded.
    gpu_gb = args.gpu_memory_gb or detected_gpu_memory_gb()
    report = grpo_patches.preflight(model_config, grpo_config=config, lora_config=lora, world_size=world_size,
                                    gpu_memory_gb=gpu_gb, reward_placement=args.placement,
                                    reward_models=[accuracy_reward, format_reward], dataset_size=len(dataset),
                                    fast_generation=args.fast_generation, lean_lora=args.lean_lora,
                                    raise_on_error=False, warn=False)
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        print(report, flush=True)
    if report.errors:
        return 1

    grpo_patches.apply(reward_placement=args.placement, fast_generation=args.fast_generation,
                       lean_lora=args.lean_lora, compile_training=args.compile_training)
    trainer = GRPOTrainer(model=load_model(), reward_funcs=[accuracy_reward, format_reward], args=config,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    grpo_patches.GRPOMonitorCallback().attach(trainer)
    checkpoint = get_last_checkpoint(args.output_dir) if args.resume and os.path.isdir(args.output_dir) else None
    if is_main and checkpoint:
        print(f"train_grpo_lora: resuming from {checkpoint}", flush=True)
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if is_main:
        print(f"train_grpo_lora: done, {trainer.state.global_step} steps; adapter in {args.output_dir}/final",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
