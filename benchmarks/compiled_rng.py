"""Where inductor's random numbers cost time: the compiled training layers' LoRA dropout and the decode
step's pick (the inverse-CDF sample, the same with the row's maximum taken in a pass of its own, and the
Gumbel-max pick it replaced), each with inductor's own generator (one Philox draw per element, fused into the
kernel that uses it) and with ``fallback_random`` (ATen's generator, four values per Philox draw, in a
kernel of its own).

    python benchmarks/compiled_rng.py --out rng.json            # a GPU: the 1.5B shapes of the GRPO grid
    python benchmarks/compiled_rng.py --tiny --rows 8 --out rng-cpu.json  # anywhere: the code path, small shapes

Training: ``--layers`` Qwen2.5-1.5B-shaped decoder layers (random weights) with the kit's pinned LoRA
(r16, dropout 0.05, seven projections), ``lean_lora`` and ``compile_training``, gradient checkpointing on,
bf16 autocast, one micro-batch of ``--micro-batch`` x ``--seq`` tokens: forward, recomputation and backward,
per layer (``--lora-dropout``, ``--modes`` vary it; ``unfused``: the kit's settings with PEFT's own gate and up
projections, no ``fused_gate_up``; ``down-inside``: without ``recompute_tail``; ``peft-dropout``: PEFT's LoRA
dropout and ``lora_A`` in place of the fused op; ``--kernels N``: each mode's largest
kernels; ``--saved``: what each mode's layer saves for its backward). Sampling, over ``[rows, vocab]`` bf16 logits at
each of ``--rows`` (1024, 192 and 8): ``sampler.pick(sampler.warp(...))`` compiled as the fused decode step compiles
it, plain (temperature 1) and with the pinned temperature 0.7 / top-p 0.9, whose top-p is timed three
ways: a sort of the vocabulary (transformers' way), ``sampler.nucleus`` at 2, 4 and 16 cuts a pass, and
``warp``'s default; and eager ``torch.multinomial`` (what transformers samples with). A variant that fails
to compile is recorded with its error.
"""

from __future__ import annotations

import argparse
import functools
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


def decoder_stack(policy: str, layers: int, device: torch.device, lora_dropout: float | None = 0.05):
    """``layers`` Qwen2.5-shaped decoder layers of ``policy`` (random weights, bf16 on a GPU) with the kit's
    pinned LoRA and ``lean_lora`` (``lora_dropout=None``: the frozen base alone), checkpointing on, in training
    mode: (the decoder stack without the LM head, its config)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_grpo import model_config
    from grpo_patches.defaults import lora_config
    from grpo_patches.lean_lora import enable_lean_lora

    cfg = model_config(policy)
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    if lora_dropout is None:  # the frozen base alone: the floor of any LoRA implementation's layer
        model = base.requires_grad_(False)
    else:
        model = get_peft_model(base, lora_config(lora_dropout=lora_dropout))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    if lora_dropout is not None:
        enable_lean_lora(model)
    return (model if lora_dropout is None else model.get_base_model()).model, cfg


def _kernels(step, top: int) -> list[dict]:
    """The ``top`` CUDA kernels of one ``step()`` by device time: name, milliseconds, calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [{"name": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count} for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"name": "(all kernels)", "ms": total, "calls": sum(r["calls"] for r in rows)}, *rows[:top]]


def _saved_mib(inner, forward) -> float:
    """MiB autograd saves per layer in one ``forward()`` without checkpointing: the unique storages its saved-tensor
    hook sees, parameters excluded (what a checkpointed layer holds from its recomputation until its backward)."""
    from benchmarks.calibrate_activations import saved_bytes

    layers = list(inner.layers)
    before = [layer.gradient_checkpointing for layer in layers]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        saved = saved_bytes(inner, forward)
    finally:
        for layer, checkpointed in zip(layers, before, strict=True):
            layer.gradient_checkpointing = checkpointed
    return saved / len(layers) / 2**20


def training(args, device: torch.device) -> dict:
    from grpo_patches import compiled_training, fused_gate_up, lora_dropout, recompute_tail

    cuda = device.type == "cuda"
    inner, cfg = decoder_stack("tiny" if args.tiny else "1.5b", args.layers, device,
                               None if args.no_lora else args.lora_dropout)
    ids = torch.randint(4, cfg.vocab_size, (args.micro_batch, args.seq), device=device)
    mask = torch.ones_like(ids)
    out: dict = {}
    modes = [("eager", None), *MODES.items()]
    if args.modes:
        modes = [(m, o) for m, o in modes if m in args.modes.split(",")]
    for extra in ("unfused", "down-inside", "peft-dropout"):
        if not args.modes or extra in args.modes.split(","):
            modes.append((extra, MODES["fallback_random"]))
    fused, down = fused_gate_up._fused, recompute_tail.down_projection
    available = lora_dropout._AVAILABLE
    for mode, options in modes:  # eager first: the layers are switched after it
        if options is not None:  # the kit's compiled layers, compiled anew with these inductor settings
            torch._dynamo.reset()
            compiled_training._OPTIONS, compiled_training._compiled = options, None
            compiled_training.enable_compiled_training(inner)
            # "unfused": the kit's settings with PEFT's own gate and up projections (no fused_gate_up)
            fused_gate_up._fused = (lambda mlp, x: None) if mode == "unfused" else fused
            # "down-inside": the kit's settings with the down projection's base matmul inside the graph
            recompute_tail.down_projection = (lambda d, a, h: d(h)) if mode == "down-inside" else down
            # "peft-dropout": the kit's settings with PEFT's dropout and lora_A, not the fused op
            lora_dropout._AVAILABLE = False if mode == "peft-dropout" else available

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
        if args.saved:
            def forward():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    return inner(input_ids=ids, attention_mask=mask).last_hidden_state

            out[mode]["saved_mib_per_layer"] = _saved_mib(inner, forward)
            print(f"  saved without checkpointing: {out[mode]['saved_mib_per_layer']:.1f} MiB per layer", flush=True)
        if args.kernels and cuda:
            out[mode]["kernels"] = _kernels(step, args.kernels)
            for row in out[mode]["kernels"]:
                print(f"  {row['ms']:9.2f} ms {row['calls']:6d}x  {row['name']}", flush=True)
    return out


def _sorted_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper (a sort of the vocabulary), the kit's top-p before ``sampler.nucleus``."""
    scores = logits.float() / temperature
    sorted_scores, order = torch.sort(scores, descending=False)
    remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - top_p)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(-1, order, remove), -float("inf"))


def gumbel_pick(scores: torch.Tensor, s) -> torch.Tensor:
    """The fused step's pick before ``sampler.inverse_cdf``: Gumbel-max, one random number per vocabulary entry."""
    if not s.do_sample:
        return scores.argmax(-1)
    u = torch.rand_like(scores).clamp_(min=torch.finfo(torch.float32).tiny)
    return (scores - torch.log(-torch.log(u))).argmax(-1)


def two_pass_pick(scores: torch.Tensor, s) -> torch.Tensor:
    """``sampler.inverse_cdf`` before its blocks' sums were taken against their own maxima: the row's maximum
    first, then the sums against it (two reads of the scores)."""
    from grpo_patches.generation.sampler import blocks_of, search_blocks

    if not s.do_sample:
        return scores.argmax(-1)
    u = torch.rand(scores.shape[0], 1, device=scores.device)
    padded = blocks_of(scores)
    top = scores.amax(-1, keepdim=True)
    return search_blocks(padded, top, torch.exp(padded - top.unsqueeze(-1)).sum(-1), u)


def _sampling_fns() -> dict:
    """The pick variants timed, by name: each a function of the logits."""
    from grpo_patches.generation import sampler
    from grpo_patches.generation.sampler import Sampler, pick, warp

    plain = Sampler(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos=(1,), pad=0)
    pinned = Sampler(do_sample=True, temperature=0.7, top_k=0, top_p=0.9, eos=(1,), pad=0)
    fallback = MODES["fallback_random"]

    def plain_pick(x, s=plain):
        return pick(warp(x, s), s)

    def sorted_pick(x, s=pinned):
        return pick(_sorted_top_p(x, s.temperature, s.top_p), s)

    def nucleus_pick(x, ways, s=pinned):
        scores = x.float() / s.temperature
        keys, bits = sampler.order_keys(x)
        return pick(scores.masked_fill(~sampler.nucleus(scores, keys, bits, s.top_p, ways), -float("inf")), s)

    fns = {"eager multinomial": lambda x: torch.multinomial(x.float().softmax(-1), 1)}
    def plain_gumbel(x, s=plain):
        return gumbel_pick(warp(x, s), s)

    def plain_two_pass(x, s=plain):
        return two_pass_pick(warp(x, s), s)

    for mode, options in MODES.items():
        fns[f"compiled plain, {mode}"] = torch.compile(plain_pick, options=dict(options))
        fns[f"compiled plain two-pass maximum, {mode}"] = torch.compile(plain_two_pass, options=dict(options))
        fns[f"compiled plain Gumbel-max, {mode}"] = torch.compile(plain_gumbel, options=dict(options))
    fns["compiled top-p 0.9 T0.7 by sort"] = torch.compile(sorted_pick, options=dict(fallback))
    for ways in (2, 4, 16):
        fns[f"compiled top-p 0.9 T0.7 by nucleus, {ways} ways"] = torch.compile(
            functools.partial(nucleus_pick, ways=ways), options=dict(fallback))
    fns["compiled top-p 0.9 T0.7 by warp (the kit's default)"] = torch.compile(
        functools.partial(plain_pick, s=pinned), options=dict(fallback))
    return fns


def sampling(args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    vocab = 512 if args.tiny else 151936
    out: dict = {}
    rows_list = sorted({int(r) for r in str(args.rows).split(",")}, reverse=True)
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16) * 3
        for name, fn in _sampling_fns().items():
            if args.sampling_names and not any(part in name for part in args.sampling_names.split("|")):
                continue
            torch._dynamo.reset()
            try:
                for _ in range(args.warmup):
                    fn(logits)
                seconds = _timed(functools.partial(fn, logits), args.reps * 4, cuda)
            except Exception as exc:  # noqa: BLE001 - a failed compile is a result too
                out[f"{name} [{rows}]"] = {"error": repr(exc)[:300]}
                print(f"sampling {name}: FAILED over [{rows}, {vocab}]: {type(exc).__name__}", flush=True)
                continue
            out[f"{name} [{rows}]"] = {"ms": seconds * 1e3}
            print(f"sampling {name}: {seconds * 1e3:.3f} ms over [{rows}, {vocab}]", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU check of the code path)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=288, help="tokens per row (32-token prompt + 256 completion)")
    p.add_argument("--rows", default="1024,192,8", help="sampling: comma list of rows of logits (generation batches)")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="training: the LoRA dropout (0: none)")
    p.add_argument("--no-lora", action="store_true", help="training: the frozen base layers alone, no adapter")
    p.add_argument("--modes", default="", help="training: a comma list of eager,inductor,fallback_random,unfused "
                   "(fallback_random without fused_gate_up),down-inside (without recompute_tail),peft-dropout (PEFT's LoRA dropout "
                   "and lora_A, not the fused op)")
    p.add_argument("--saved", action="store_true", help="training: also the MiB autograd saves per layer in a forward "
                   "without checkpointing (held from a layer's recomputation to its backward)")
    p.add_argument("--kernels", type=int, default=0, help="training, on a GPU: also list each mode's N largest CUDA "
                   "kernels of one micro-batch")
    p.add_argument("--no-sampling", action="store_true")
    p.add_argument("--sampling-names", default="", help="sampling: time only the variants whose names hold one of "
                   "these |-separated parts")
    p.add_argument("--no-training", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.tiny:
        args.micro_batch, args.seq, args.rows, args.layers = 2, 16, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "sampling": None if args.no_sampling else sampling(args, device),
              "training": None if args.no_training else training(args, device)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
