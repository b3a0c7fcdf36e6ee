"""Benchmark: TRL's default (eager) generation vs grpo_patches fast generation.

Two modes, random-weight Qwen2.5-like policies (no hub access needed), LoRA r16 on all 7 projections
with a random (nonzero) B, batch 8, 256 new tokens (every row runs to the end: min_new_tokens):

* default (``generate``): ``model.generate`` with TRL 1.16's generation config (built as TRL builds
  it, ``disable_compile=True``, policy in training mode as TRL samples) vs :func:`fast_generate`
  (static cache, compiled decode step, eval mode). Reports ms per decode step, the first compiled
  call (compilation), recompilations over later calls with other prompt lengths, and the HBM floor
  (bytes of the parameters / 4.8 TB/s for an H200; the KV cache read is listed separately).
* ``--trl-step``: stock ``GRPOTrainer`` steps vs the same trainer with fast generation
  (:func:`enable_fast_generation`, what ``apply(fast_generation=True)`` installs): the first step
  (compilation) separately, then the mean of ``--steps`` timed steps and their generation share.

Prints a markdown table and writes JSON to ``--out``.

    python benchmarks/bench_generation.py --policy 0.5b,1.5b --out benchmarks/results/generation.json
    python benchmarks/bench_generation.py --trl-step --policy 1.5b --out benchmarks/results/generation_trl.json
    python benchmarks/bench_generation.py --policy tiny --force-compile --backend aot_eager   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_patches.generation import FastGenerationConfig, enable_fast_generation, fast_generate  # noqa: E402

H200_BYTES_PER_S = 4.8e12
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
POLICIES = {
    # Qwen2.5-0.5B / 1.5B shapes (tied embeddings, GQA with 2 KV heads, vocab 151936)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
PAD, EOS, BOS = 0, 1, 2


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def build_policy(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(max_position_embeddings=4096, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
                         **POLICIES[name])
    with torch.device(device):  # random init directly on the GPU (seconds, not minutes, for 1.5B)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    return model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=PROJ, task_type="CAUSAL_LM")


def randomize_lora_b(model, seed: int = 1):
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)


def floor_ms(model, batch: int, cache_len: int) -> tuple[float, float]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * cache_len * batch * 2  # bf16 K and V
    return params / H200_BYTES_PER_S * 1e3, kv / H200_BYTES_PER_S * 1e3


def trl_generation_config(new_tokens: int):
    """TRL 1.16's GenerationConfig for the transformers path (GRPOConfig defaults), full-length rows."""
    from transformers import GenerationConfig

    kwargs = {"max_new_tokens": new_tokens, "do_sample": True, "pad_token_id": PAD, "bos_token_id": BOS,
              "eos_token_id": [EOS], "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
              "repetition_penalty": 1.0, "cache_implementation": None, "min_new_tokens": new_tokens}
    return GenerationConfig(**kwargs, disable_compile=True)


def prompts(batch: int, length: int, vocab: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    lengths = torch.randint(max(1, length // 2), length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] >= (length - lengths)[:, None]).long()  # left-padded, as TRL pads
    ids = ids.masked_fill(mask == 0, PAD)
    return ids.to(device), mask.to(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def bench_generate(name: str, args, device, dtype) -> dict:
    from peft import get_peft_model

    model, lora = build_policy(name, dtype, device)
    model = get_peft_model(model, lora)
    randomize_lora_b(model)
    vocab = model.config.vocab_size
    new, batch = args.new_tokens, args.batch
    base_config = trl_generation_config(new)
    one_token = trl_generation_config(1)
    L = args.prompt_length  # later calls use other prompt lengths (same bucket): no recompilation expected
    lengths = [L - d for d in (0, L // 8, L // 4, L // 16, L // 3, L // 5)][: args.repeats + 1]
    res: dict = {"policy": name, "batch": batch, "new_tokens": new, "prompt_lengths": lengths,
                 "params": sum(p.numel() for p in model.parameters()),
                 "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}

    # stock TRL: eager, dynamic cache, policy in training mode (LoRA dropout on) as TRL samples
    model.train()
    eager = []
    for i, length in enumerate(lengths):
        ids, mask = prompts(batch, length, vocab, device, seed=i)
        with torch.no_grad():
            t_pre, _ = timed(lambda i=ids, m=mask: model.generate(input_ids=i, attention_mask=m,
                                                                  generation_config=one_token), device)
            t, out = timed(lambda i=ids, m=mask: model.generate(input_ids=i, attention_mask=m,
                                                                generation_config=base_config), device)
        assert out.shape[1] == length + new, out.shape
        if i > 0 or len(lengths) == 1:  # the first call warms up kernels / allocator
            eager.append((t, t_pre))
    res["eager_s_per_call"] = statistics.mean(t for t, _ in eager)
    res["eager_ms_per_decode_step"] = statistics.mean((t - p) / max(new - 1, 1) * 1e3 for t, p in eager)

    # fast path
    config = FastGenerationConfig(force_compile=args.force_compile, backend=args.backend, mode=args.mode,
                                  bucket=args.bucket)
    fast, first = [], None
    graphs_before = graphs()
    for i, length in enumerate(lengths):
        ids, mask = prompts(batch, length, vocab, device, seed=i)
        t_pre, _ = timed(lambda i=ids, m=mask: fast_generate(model, i, m, generation_config=one_token, config=config),
                         device)
        t, out = timed(lambda i=ids, m=mask: fast_generate(model, i, m, generation_config=base_config, config=config),
                       device)
        assert out.shape[1] == length + new, out.shape
        if i == 0:
            first = t
            graphs_warm = graphs()
        else:
            fast.append((t, t_pre))
    res["fast_first_call_s"] = first
    res["graphs_compiled_first_call"] = graphs_warm - graphs_before
    res["recompiles_after_warmup"] = graphs() - graphs_warm
    if fast:
        res["fast_s_per_call"] = statistics.mean(t for t, _ in fast)
        res["fast_ms_per_decode_step"] = statistics.mean((t - p) / max(new - 1, 1) * 1e3 for t, p in fast)
        res["speedup_decode"] = res["eager_ms_per_decode_step"] / res["fast_ms_per_decode_step"]
    cache_len = -(-max(lengths) // args.bucket) * args.bucket + new
    res["hbm_floor_ms_params"], res["hbm_kv_ms_full_cache"] = floor_ms(model, batch, cache_len)
    model = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return res


# --trl-step ----------------------------------------------------------------------------------------


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   model_input_names=["input_ids", "attention_mask"])


def length_reward(completions, **kwargs):
    return [len(c.split()) / 256.0 for c in completions]


def run_trl(name: str, args, device, dtype, fast: bool) -> dict:
    import random

    import wrapt
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, lora = build_policy(name, dtype, device)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    rows = [{"prompt": " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(args.prompt_length // 2,
                                                                                          args.prompt_length)))}
            for _ in range(64)]
    on_cpu = device.type != "cuda"
    config = GRPOConfig(
        output_dir=os.path.join(args.workdir, f"{name}-{'fast' if fast else 'stock'}"), report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, per_device_train_batch_size=args.batch,
        num_generations=args.batch, max_completion_length=args.new_tokens, max_steps=1 + args.steps,
        learning_rate=1e-6, seed=0, use_cpu=on_cpu, bf16=dtype == torch.bfloat16 and not on_cpu,
        generation_kwargs={"min_new_tokens": args.new_tokens}, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer(vocab),
                          peft_config=lora)
    randomize_lora_b(trainer.model)
    state = enable_fast_generation(trainer, FastGenerationConfig(
        force_compile=args.force_compile, backend=args.backend, mode=args.mode, bucket=args.bucket)) if fast else None
    gen_seconds: list[float] = []

    def timing(wrapped, instance, a, kw):
        sync(device)
        start = time.perf_counter()
        out = wrapped(*a, **kw)
        sync(device)
        gen_seconds.append(time.perf_counter() - start)
        return out

    wrapt.wrap_function_wrapper(trainer, "_generate_single_turn", timing)
    step_seconds: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            step_seconds.append(time.perf_counter() - self.start)

    trainer.add_callback(Clock())
    trainer.train()
    timed_steps, timed_gen = step_seconds[1:], gen_seconds[1:]
    res = {"policy": name, "mode": "fast" if fast else "stock", "first_step_s": step_seconds[0],
           "first_generation_s": gen_seconds[0], "step_s": statistics.mean(timed_steps),
           "generation_s": statistics.mean(timed_gen), "steps_timed": len(timed_steps)}
    res["generation_share"] = res["generation_s"] / res["step_s"]
    if state is not None:
        res["fast_state"] = state.summary()
    trainer = model = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return res


def table(rows: list[dict], keys: list[tuple[str, str]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(h for h, _ in keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for _, k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="0.5b,1.5b", help="comma list of: " + ", ".join(POLICIES))
    ap.add_argument("--trl-step", action="store_true", help="time GRPOTrainer steps, stock vs fast")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (16 for tiny)")
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls after the first (generate mode)")
    ap.add_argument("--steps", type=int, default=5, help="timed trainer steps after the first (--trl-step)")
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--force-compile", action="store_true", help="compile on CPU too")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workdir", default="/tmp/bench_generation")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    if unknown := [n for n in names if n not in POLICIES]:
        ap.error(f"unknown policy {unknown}; choose from {list(POLICIES)}")
    if args.new_tokens is None:
        args.new_tokens = 16 if names == ["tiny"] else 256
    if names == ["tiny"] and args.prompt_length == 128:
        args.prompt_length = 24
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore", message=".*(generation flags|not valid|deprecated).*")

    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "args": vars(args)}
    for mod in ("transformers", "peft", "trl"):  # trl is needed by --trl-step only
        try:
            meta[mod] = __import__(mod).__version__
        except ImportError:
            meta[mod] = None
    rows = []
    if args.trl_step:
        for name in names:
            for fast in (False, True):
                rows.append(run_trl(name, args, device, dtype, fast))
                print(json.dumps(rows[-1], default=str), flush=True)
        print(table(rows, [("policy", "policy"), ("path", "mode"), ("first step s", "first_step_s"),
                           ("first generation s", "first_generation_s"), ("step s", "step_s"),
                           ("generation s", "generation_s"), ("generation share", "generation_share"),
                           ("timed steps", "steps_timed")]))
    else:
        for name in names:
            rows.append(bench_generate(name, args, device, dtype))
            print(json.dumps(rows[-1], default=str), flush=True)
        print(table(rows, [("policy", "policy"), ("eager ms/step", "eager_ms_per_decode_step"),
                           ("fast ms/step", "fast_ms_per_decode_step"), ("speed-up", "speedup_decode"),
                           ("HBM floor ms/step (params)", "hbm_floor_ms_params"),
                           ("KV read ms/step (full cache)", "hbm_kv_ms_full_cache"),
                           ("first fast call s (compile)", "fast_first_call_s"),
                           ("recompiles after warm-up", "recompiles_after_warmup"),
                           ("eager s/call", "eager_s_per_call"), ("fast s/call", "fast_s_per_call")]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
