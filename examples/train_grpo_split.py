"""GRPO + LoRA with the policy's layers split across the GPUs of one process (a device_map pipeline).

    python examples/train_grpo_split.py --model tiny --max-steps 2               # CPU, built-in tiny model
    accelerate launch --config_file examples/accelerate/pipeline.yaml examples/train_grpo_split.py \\
        --model meta-llama/Llama-3.1-70B-Instruct --stages 4 --quantization nf4 \\
        --per-device-batch 4 --steps-per-generation 8 --num-generations 8 --max-completion-length 512
    accelerate launch --config_file examples/accelerate/pipeline_dp.yaml examples/train_grpo_split.py \\
        --model <path> --stages 2                                                # 2 ranks x 2 GPUs each

Each process drives ``--stages`` devices (rank r takes GPUs r*stages .. r*stages+stages-1, or the
``--devices`` it is given, e.g. ``cuda:0,cpu``): the embedding on the first, the decoder layers in
order (``--layers`` counts per device, default an even split), the final norm and an untied LM head on
the last. Only hidden states cross devices. With several processes it is data parallelism over such
pipelines: the kit keeps each group of completions on one rank. ``grpo-patches doctor ... --plan``
predicts the memory per device and the extra time per round of these layouts ("pipeline P", "pipeline
P x dp D"). ``--trainer vendored`` runs the vendored DeepSeekMath-style trainer instead of TRL's.
``--report FILE``: rank 0 writes its devices' peak memory and the time per step as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import grpo_patches  # noqa: E402
from grpo_patches.defaults import lora_config  # noqa: E402
from grpo_patches.preflight.pipeline_split import layers_per_stage  # noqa: E402

#: The random-weight models' shapes ("qwen2-1.5b-random" is Qwen2-1.5B's).
RANDOM_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "qwen2-1.5b-random": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                              num_key_value_heads=2, vocab_size=151936),
}
PROMPTS = [f"Write the letter {c} {n} times:" for c in "abcdefgh" for n in range(2, 10)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a model path / hub name, 'tiny' (CPU test size) or "
                   "'qwen2-1.5b-random' (a random-weight model of Qwen2-1.5B's shape)")
    p.add_argument("--untied-head", action="store_true", help="the random-weight models with an LM head of their "
                   "own (tie_word_embeddings=False), placed on the last device; tied, it stays with the embedding")
    p.add_argument("--stages", type=int, default=2, help="devices per process")
    p.add_argument("--devices", default=None, help="comma-separated devices of this process (default: its GPUs, or cpu)")
    p.add_argument("--layers", default=None, help="comma-separated decoder layers per device (default: even split)")
    p.add_argument("--quantization", choices=("nf4", "int8"), default=None, help="a bitsandbytes base (hub models)")
    p.add_argument("--trainer", choices=("trl", "vendored"), default="trl")
    p.add_argument("--output-dir", default="grpo_split_output")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--per-device-batch", type=int, default=4, help="per process: the stages' shares together")
    p.add_argument("--steps-per-generation", type=int, default=1)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--fast-generation", action="store_true",
                   help="the kit's fast generation (decodes eagerly on a split policy, and says why)")
    p.add_argument("--report", default=None, help="rank 0 writes its devices' peak memory and step times here (JSON)")
    return p.parse_args(argv)


def process_devices(args: argparse.Namespace) -> list[str]:
    if args.devices:
        return args.devices.split(",")
    import torch

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        return [f"cuda:{rank * args.stages + i}" for i in range(args.stages)]
    return ["cpu"] * args.stages


def split_device_map(config, devices: list[str], layers: list[int] | None = None) -> dict[str, str]:
    """``device_map`` for a Llama / Qwen2-style causal LM: embedding first, layers in order, head last
    (a tied head stays with the embedding)."""
    counts = layers or layers_per_stage(config.num_hidden_layers, len(devices))
    if sum(counts) != config.num_hidden_layers or len(counts) != len(devices):
        raise SystemExit(f"--layers {counts} must give {len(devices)} counts summing to {config.num_hidden_layers}.")
    first, last = devices[0], devices[-1]
    out = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": last,
           "lm_head": first if getattr(config, "tie_word_embeddings", False) else last}
    i = 0
    for device, n in zip(devices, counts, strict=True):
        for _ in range(n):
            out[f"model.layers.{i}"] = device
            i += 1
    return out


def dispatch_split(model, device_map: dict[str, str]):
    """Each module on its device and run there, with accelerate's hooks moving the hidden states between
    devices (``accelerate.dispatch_model`` would treat "cpu" as offload: weights streamed to the GPU)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, attach_align_device_hook_on_blocks

    for name, device in device_map.items():
        model.get_submodule(name).to(device)
    attach_align_device_hook_on_blocks(model, execution_device=dict(device_map),
                                       offload={name: False for name in device_map}, offload_buffers=False,
                                       weights_map=None, skip_keys=getattr(model, "_skip_keys_device_placement", None))
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)  # outputs back on the inputs' device
    model.hf_device_map = dict(device_map)
    return model


def load_policy(args: argparse.Namespace, devices: list[str]):
    """The policy dispatched over ``devices`` (accelerate's hooks move hidden states between them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    dtype = torch.bfloat16 if any(d.startswith("cuda") for d in devices) else torch.float32
    if args.model in RANDOM_SHAPES:
        config = Qwen2Config(**RANDOM_SHAPES[args.model], max_position_embeddings=4096, tie_word_embeddings=not args.untied_head, pad_token_id=0,
                             eos_token_id=1, bos_token_id=1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return dispatch_split(model, split_device_map(config, devices, layers))
    config = AutoConfig.from_pretrained(args.model)
    kwargs = {"dtype": dtype, "device_map": split_device_map(config, devices, layers)}
    if args.quantization:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = (BitsAndBytesConfig(load_in_8bit=True) if args.quantization == "int8" else
                                         BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                            bnb_4bit_use_double_quant=True,
                                                            bnb_4bit_compute_dtype=torch.bfloat16))
    return AutoModelForCausalLM.from_pretrained(args.model, **kwargs)


def tokenizer_for(args: argparse.Namespace, vocab: int):
    if args.model not in RANDOM_SHAPES:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.model)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for p in PROMPTS for w in p.split()} | set("abcdefgh"))
    vocab_map = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   model_input_names=["input_ids", "attention_mask"])


def letter_reward(completions, prompts=None, **_):
    """Share of the completion's words that are the prompt's letter."""
    out = []
    for i, text in enumerate(completions):
        text = text if isinstance(text, str) else text[-1]["content"]
        goal = (prompts[i] if prompts else "a a a a a").split()[4]
        words = text.split()
        out.append(sum(w == goal for w in words) / max(len(words), 1))
    return out


class StepTimer:
    """Wall time per optimizer step and each device's peak memory (torch's allocator on a GPU; the
    process's peak resident set on the CPU)."""

    def __init__(self, after_step=None) -> None:
        self.times: list[float] = []
        self._t = time.perf_counter()
        self.after_step = after_step  # e.g. rewrite the report, so a run stopped early still leaves one

    def step(self) -> None:
        import torch

        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
        now = time.perf_counter()
        self.times.append(now - self._t)
        if self.after_step is not None:
            self.after_step(self)
        self._t = time.perf_counter()

    @staticmethod
    def peaks(devices: list[str], reserved: bool = False) -> dict[str, float]:
        """GiB per device: torch's peak allocated (``reserved``: the allocator's peak reserved) on a GPU."""
        import torch

        out = {}
        for d in sorted(set(devices)):
            if d.startswith("cuda"):
                peak = torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated
                out[d] = peak(torch.device(d)) / 2**30
            else:
                out[d] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
        return out


def trl_config(args: argparse.Namespace, cuda: bool):
    """The GRPOConfig the TRL run uses (also what a memory estimate of this run should read)."""
    from trl import GRPOConfig

    return GRPOConfig(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_batch,
                      steps_per_generation=args.steps_per_generation, num_generations=args.num_generations,
                      max_completion_length=args.max_completion_length, learning_rate=1e-4, logging_steps=1,
                      report_to=[], save_strategy="no", bf16=cuda, use_cpu=not cuda, seed=7,
                      gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True)


def train_trl(args, model, tokenizer, timer: StepTimer, world: int) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class Timing(TrainerCallback):
        def on_step_end(self, *a, **k):
            timer.step()

    config = trl_config(args, cuda=any(d.startswith("cuda") for d in process_devices(args)))
    trainer = GRPOTrainer(model=model, reward_funcs=letter_reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * max(1, world)}),
                          peft_config=lora_config(r=4), callbacks=[Timing()])
    trainer.train()


def train_vendored(args, model, tokenizer, timer: StepTimer) -> None:
    from peft import get_peft_model

    from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer

    config = DSMGRPOConfig(num_generations=args.num_generations, max_new_tokens=args.max_completion_length,
                           per_device_batch_size=args.per_device_batch, learning_rate=1e-4)
    trainer = DSMGRPOTrainer(get_peft_model(model, lora_config(r=4)), tokenizer, letter_reward, config)
    trainer.train(PROMPTS, steps=args.max_steps, on_step=lambda i, metrics: timer.step())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # accelerate refuses a dispatched model in a distributed run unless told this is on purpose
        os.environ.setdefault("ACCELERATE_BYPASS_DEVICE_MAP", "true")
    devices = process_devices(args)
    grpo_patches.apply(fast_generation=True if args.fast_generation else None,
                       targets=("vendored",) if args.trainer == "vendored" else ("trl", "vendored"))
    model = load_policy(args, devices)
    print(f"policy split over {devices}: {sorted(set(map(str, model.hf_device_map.values())))} "
          f"({len(model.hf_device_map)} modules placed)", flush=True)
    tokenizer = tokenizer_for(args, model.config.vocab_size)

    def write_report(timer: StepTimer) -> None:
        # rank 0's devices only (every rank writing one path interleaves the files), replaced whole so a
        # reader never sees half a report
        if args.report and int(os.environ.get("RANK", "0")) == 0:
            tmp = Path(f"{args.report}.tmp")
            tmp.write_text(json.dumps(
                {"devices": devices, "step_seconds": timer.times, "peak_gib": StepTimer.peaks(devices),
                 "peak_reserved_gib": StepTimer.peaks(devices, reserved=True), "args": vars(args),
                 "world_size": world}, indent=1))
            os.replace(tmp, args.report)

    timer = StepTimer(after_step=write_report)
    if args.trainer == "vendored":
        train_vendored(args, model, tokenizer, timer)
    else:
        train_trl(args, model, tokenizer, timer, world)
    write_report(timer)
    print(f"done, {len(timer.times)} steps; step seconds {[round(t, 2) for t in timer.times]}; "
          f"peak GiB per device {({k: round(v, 2) for k, v in StepTimer.peaks(devices).items()})}", flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a process group left to interpreter exit can abort a rank
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
