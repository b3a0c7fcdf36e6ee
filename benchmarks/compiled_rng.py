"""Where inductor's random numbers cost time: the compiled training layers' LoRA dropout and the decode
step's Gumbel-max pick, each with inductor's own generator (one Philox draw per element, fused into the
kernel that uses it) and with ``fallback_random`` (ATen's generator, four values per Philox draw, in a
kernel of its own).

    python benchmarks/compiled_rng.py --out rng.json            # a GPU: the 1.5B shapes of the GRPO grid
    python benchmarks/compiled_rng.py --tiny --out rng-cpu.json  # anywhere: the code path, small shapes

Training: ``--layers`` Qwen2.5-1.5B-shaped decoder layers (random weights) with the kit's pinned LoRA
(r16, dropout 0.05, seven projections), ``lean_lora`` and ``compile_training``, gradient checkpointing on,
bf16 autocast, one micro-batch of ``--micro-batch`` x ``--seq`` tokens: forward, recomputation and backward,
per layer. Sampling: ``sampler.pick(sampler.warp(...))`` over ``[--rows, vocab]`` bf16 logits, compiled
as the fused decode step compiles it, and eager ``torch.multinomial`` (what transformers samples with).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = {"inductor": {}, "fallback_random": {"fallback_random": True}}


def _timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (after the caller's warm-up)."""
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def training(args, device: torch.device) -> dict:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_grpo import model_config
    from grpo_patches import compiled_training
    from grpo_patches.defaults import lora_config
    from grpo_patches.lean_lora import enable_lean_lora

    cuda = device.type == "cuda"
    cfg = model_config("tiny" if args.tiny else "1.5b")
    cfg.num_hidden_layers = args.layers
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    model = get_peft_model(base, lora_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    enable_lean_lora(model)
    ids = torch.randint(4, cfg.vocab_size, (args.micro_batch, args.seq), device=device)
    mask = torch.ones_like(ids)
    inner = model.get_base_model().model  # the decoder stack: no LM head, so the time is the layers'
    out: dict = {}
    for mode, options in [("eager", None), *MODES.items()]:  # eager first: the layers are switched after it
        if options is not None:  # the kit's compiled layers, compiled anew with these inductor settings
            torch._dynamo.reset()
            compiled_training._OPTIONS, compiled_training._compiled = options, None
            compiled_training.enable_compiled_training(model)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                hidden = inner(input_ids=ids, attention_mask=mask).last_hidden_state
            hidden.float().pow(2).mean().backward()

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        first = time.perf_counter() - t0
        seconds = _timed(step, args.reps, cuda)
        out[mode] = {"micro_batch_s": seconds, "per_layer_ms": seconds / args.layers * 1e3,
                     "warmup_s": first, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        print(f"training {mode}: {seconds * 1e3:.1f} ms per micro-batch, {out[mode]['per_layer_ms']:.2f} ms per layer "
              f"(warm-up {first:.1f} s)", flush=True)
    return out


def sampling(args, device: torch.device) -> dict:
    from grpo_patches.generation.sampler import Sampler, pick, warp

    cuda = device.type == "cuda"
    vocab = 512 if args.tiny else 151936
    s = Sampler(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos=(1,), pad=0)
    logits = torch.randn(args.rows, vocab, device=device, dtype=torch.bfloat16)
    out: dict = {}
    fns = {"eager multinomial": lambda: torch.multinomial(logits.float().softmax(-1), 1)}
    for mode, options in MODES.items():
        torch._dynamo.reset()
        fns[f"compiled, {mode}"] = torch.compile(lambda x: pick(warp(x, s), s), options=dict(options))
    for name, fn in fns.items():
        call = (lambda f=fn: f(logits)) if name.startswith("compiled") else fn
        for _ in range(args.warmup):
            call()
        seconds = _timed(call, args.reps * 4, cuda)
        out[name] = {"ms": seconds * 1e3}
        print(f"sampling {name}: {seconds * 1e3:.3f} ms over [{args.rows}, {vocab}]", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU check of the code path)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=288, help="tokens per row (32-token prompt + 256 completion)")
    p.add_argument("--rows", type=int, default=1024, help="sampling: rows of logits (the generation batch)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.tiny:
        args.micro_batch, args.seq, args.rows, args.layers = 2, 16, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "sampling": sampling(args, device), "training": training(args, device)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
