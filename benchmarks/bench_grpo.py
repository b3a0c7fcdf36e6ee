"""Stock vs patched TRL GRPOTrainer: step time, phase times and peak memory per rank, in one invocation.

One process per GPU (``accelerate launch`` / ``torchrun``); inside each process the variants run
alternately (stock, patched-local, patched-main, [stock, ...] with ``--rounds``), each with a fresh
trainer built from the same random weights, so drift hits every variant alike::

    accelerate launch --num_processes 2 --multi_gpu --mixed_precision bf16 benchmarks/bench_grpo.py \\
        --policy 0.5b --grad-ckpt on --steps 5 --warmup 1

    # CPU smoke test (gloo):
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_grpo.py --policy tiny \\
        --steps 2 --warmup 1 --out /tmp/benchout

    # largest per-device batch under a 24 GB cap, each probe a fresh launch of NPROC ranks:
    python benchmarks/bench_grpo.py --find-max-batch --nproc 2 --mem-cap-gb 24 --policy 0.5b

    # best layout against best layout: stock and the kit's speed path over micro-batch x generation
    # batch at 1024 completions per step under a 24 GB cap (--dry-run lists the grid, runs nothing;
    # --report-only prints the tables of what the rows recorded, each phase against its own floor):
    python benchmarks/bench_grpo.py --grid --policy 1.5b --completions-per-step 1024 --mem-cap-gb 24

Policy: a Qwen2.5-0.5B- or 1.5B-like Qwen2 with random weights (no hub) + LoRA r=16, alpha=32,
dropout 0.05 on all seven projections. Rewards: a rule reward and a 0.5B-class reward model
(Qwen2ForSequenceClassification, num_labels=1), built inside each variant and given to the trainer
as an ``nn.Module`` (under ``reward_placement="main"`` the patch keeps it off the other ranks).

Per (variant, rank) it records every timed step (CUDA-synchronized at step begin/end) and its
phases: ``generate`` (``_generate``), ``rewards`` (``_calculate_rewards``), ``score_other`` (rest
of ``_generate_and_score_completions``: log-probs, advantages), ``loss_backward``
(``training_step`` minus ``_prepare_inputs``) and ``other`` (optimizer step, callbacks); completion
tokens per second; peak allocated / reserved memory. TRL 1.16 sends its own ``profiling/...``
timings only to wandb / mlflow / trackio, so the phases are timed here by wrapping the trainer
instance's methods.

Output under ``--out`` (default ``benchmarks/results/<date>-<gpu>/``): ``results.jsonl`` (one
line per variant and rank, appended), ``results.md`` (tables, ratios patched/stock, target checks)
and ``step_time.png``, ``phases.png``, ``memory.png``, all regenerated from every line of
``results.jsonl`` (and ``maxbatch.jsonl``) on each run. Each record also holds the allocator's
counters over the run (retries after a failed allocation, cudaMalloc / cudaFree counts).

Profiles of one timed method (e.g. ``training_step``) into ``BENCH_PROFILE_DIR``: ``BENCH_PROFILE=name``
its Python call tree (cProfile), ``BENCH_KERNELS=name[,name]`` their CUDA kernels by kind and by name (the
last call's, ``kernels-<name>-<variant>-rank<r>.json``; a call inside another profiled one, such as sampling
inside a training step, runs unprofiled), ``BENCH_TRACE=name[,name]`` a host + device timeline of its first
timed call, or with ``step`` of the whole first timed step (a gzipped Chrome trace, ``trace-<name>-<variant>-rank<r>.json.gz``, with Python stacks where
``BENCH_TRACE_STACK`` names it; open it in Perfetto; a training step's is one after that step's sampling;
``benchmarks/trace_gaps.py`` lists its device idle gaps). All three slow the profiled calls: profile in a run of its own, not in the one whose step times
are reported. ``BENCH_REWARD_MODEL_ROWS=n`` sets the kit's reward-model forward size (``rewards.REWARD_MODEL_ROWS``;
0: one forward per batch, as stock) for an A/B, ``BENCH_PICK=gumbel`` the fast generation's Gumbel-max pick in place
of its inverse-CDF sample, ``BENCH_FUSED_GATE_UP=0`` the compiled layers with PEFT's own gate and up projections, ``BENCH_FUSED_DROPOUT=0``
the lean layers with PEFT's LoRA dropout and ``lora_A`` (not the fused op), ``BENCH_DROPOUT_TILES`` the fused
op's tiles (``lora_dropout.TILES`` as JSON),
``BENCH_DOWN_LAST=0`` with the down projection's base matmul inside their graph (recomputed with checkpointing),
``BENCH_SHARED_PROMPT=0`` the decode attention kernel reading every row's own copy of its prompt's slots (not the
prompt's first row's), ``BENCH_PLAIN_LAYERS=n`` the last n decoder layers without gradient checkpointing (their activations kept,
no recomputation), ``BENCH_NAN_FILTER=0`` the Trainer's ``logging_nan_inf_filter`` off (its per-micro-batch check of the loss waits for the device), ``BENCH_OVERLAP=1`` the trainer without the host's two waits between micro-batches (``grpo_patches/overlap.py``; ``apply``'s ``overlap_micro_batches``, on in the speed variants), ``BENCH_ALTERNATE_OVERLAP=1`` the same with the steps cycling through its pieces (both, neither, the loss filter alone; ``overlap_mode`` in each step's record), ``BENCH_GC_FREEZE=1`` Python's collector frozen (``gc.freeze()``) after the warm-up steps, ``BENCH_KEEP_CACHE=1``
the fast generation emptying the allocator's cache only where the last capture's pool does not fit (not also where
a quarter of the allowed memory is not left), ``BENCH_CAPTURE_SYNC=1`` the capture waiting for the device before
it records the round's graph (where it records while the device still runs the prefill), ``BENCH_PREFILL_ALL=1``
the fast generation's prefill over every row (where it prefills each prompt's G copies once). ``BENCH_SYNC=step`` waits
for the device only at each step's start and end, not around each timed method as by default: the step's time
is then the one of an uninstrumented run (the host's work before a micro-batch's first kernel overlaps the
previous backward), and the phase times are the host's (the time to queue a phase's work, less what an earlier
phase left on the device).
The grid driver writes a row's log as the row runs; it starts the row after its own imports and preflight, so a
command around it needs more time than ``--probe-timeout`` (a minute more).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: variant -> (apply() options or None for stock TRL, GRPOConfig overrides). ``stock-nofind`` is stock
#: with the kit's pinned ``ddp_find_unused_parameters=False`` (the one memory default measured alone);
#: ``patched-fast`` / ``patched-graph``: local rewards + fast generation with transformers' / the
#: kit's decode loop. ``stock-graph`` is unpatched TRL whose trainer alone gets the kit's fast
#: generation (``enable_fast_generation``): against ``patched-graph`` it isolates the patch's own
#: cost with the same, low-noise generation (eager generation varies 10-18% between runs).
VARIANTS: dict[str, tuple[dict[str, Any] | None, dict[str, Any]]] = {
    "stock": (None, {}),
    "stock-nofind": (None, {"ddp_find_unused_parameters": False}),
    "stock-graph": (None, {}),
    "patched-local": ({"reward_placement": "local"}, {}),
    "patched-main": ({"reward_placement": "main"}, {}),
    "patched-fast": ({"reward_placement": "local", "fast_generation": {"decode_loop": "transformers"}}, {}),
    "patched-graph": ({"reward_placement": "local", "fast_generation": {"decode_loop": "graph"}}, {}),
    # the graph loop without the merged buffer: adapter matmuls at every token, caches kept through training
    "patched-graph-unmerged": ({"reward_placement": "local", "fast_generation": {
        "decode_loop": "graph", "merge_lora": False, "release_after_sampling": False}}, {}),
    # the adapter's matmuls at every token (no 2.4 GiB buffer for the 1.5B policy), caches released
    "patched-graph-nomerge": ({"reward_placement": "local", "fast_generation": {
        "decode_loop": "graph", "merge_lora": False}}, {}),
    # the graph loop over the model's own forward (the default before the fused step): merged buffer, released
    "patched-graph-model": ({"reward_placement": "local", "fast_generation": {
        "decode_loop": "graph", "fused_decode": False}}, {}),
    # merged buffer, but caches and buffer kept through training (no re-allocation between rounds)
    "patched-graph-kept": ({"reward_placement": "local", "fast_generation": {
        "decode_loop": "graph", "release_after_sampling": False}}, {}),
    # + LoRA layers without PEFT's fp32 copy of their inputs under autocast (grpo_patches/lean_lora.py)
    "patched-graph-lean": ({"reward_placement": "local", "fast_generation": {"decode_loop": "graph"},
                            "lean_lora": True}, {}),
    # + the fused loop's CUDA graph kept between rounds (caches and buffer still freed): no capture per round
    "patched-graph-kg": ({"reward_placement": "local", "fast_generation": {"decode_loop": "graph", "keep_graph": True}},
                         {}),
    "patched-graph-lean-kg": ({"reward_placement": "local", "fast_generation": {"decode_loop": "graph",
                                                                                "keep_graph": True},
                               "lean_lora": True}, {}),
    # + the decoder layers compiled for the training forward / backward (grpo_patches/compiled_training.py)
    "patched-graph-compiled": ({"reward_placement": "local", "fast_generation": {"decode_loop": "graph"},
                                "compile_training": True}, {}),
    "patched-graph-lean-kg-compiled": ({"reward_placement": "local", "fast_generation": {
        "decode_loop": "graph", "keep_graph": True}, "lean_lora": True, "compile_training": True}, {}),
    # apply(speed=True): fast_generation + lean_lora + compile_training + compile_reward_models + freeze_gc +
    # overlap_micro_batches, each at its defaults
    "patched-speed": ({"reward_placement": "local", "speed": True}, {}),
    # the same keeping the fused loop's CUDA graph between rounds (replayed where the caches come back in place)
    "patched-speed-kg": ({"reward_placement": "local", "speed": True, "fast_generation": {"keep_graph": True}}, {}),
    # the same with the reward model scoring eagerly, as stock
    "patched-speed-eager-rm": ({"reward_placement": "local", "speed": True, "compile_reward_models": False}, {}),
    # the same with graph_steps named: one decode step per CUDA graph (the default), or check_every (16) steps
    "patched-speed-g1": ({"reward_placement": "local", "speed": True, "fast_generation": {"graph_steps": 1}}, {}),
    "patched-speed-g16": ({"reward_placement": "local", "speed": True, "fast_generation": {"graph_steps": None}}, {}),
    # the same with the fused step's attention as matmuls over the whole static cache (no Triton kernel)
    "patched-speed-matmul": ({"reward_placement": "local", "speed": True,
                              "fast_generation": {"decode_attention": "matmul"}}, {}),
    # Liger-Kernel's RMSNorm / SwiGLU / RoPE kernels (TRL's use_liger_kernel): on stock TRL, and in place
    # of compile_training on the kit's speed path
    "stock-liger": (None, {"use_liger_kernel": True}),
    # the kit's pinned sampler (grpo_config(): temperature 0.7, top-p 0.9) instead of GRPOConfig's 1.0 / 1.0
    "stock-pinned-sampler": (None, {"temperature": 0.7, "top_p": 0.9}),
    "patched-speed-pinned-sampler": ({"reward_placement": "local", "speed": True}, {"temperature": 0.7, "top_p": 0.9}),
    "patched-speed-liger": ({"reward_placement": "local", "speed": True, "compile_training": False},
                            {"use_liger_kernel": True}),
}
#: (variant, baseline, target): the patch's overhead where both sides generate the same way.
OVERHEAD_PAIRS = [("patched-graph", "stock-graph", 1.01)]
#: step time / stock targets: no overhead for the patches alone, 5x faster with fast generation.
STEP_TARGETS = {"patched-local": 1.01, "patched-main": 1.01, "patched-fast": 0.2, "patched-graph": 0.08}
#: timed methods whose own peak allocated and reserved memory each step records (``<name>_peak_bytes``,
#: ``<name>_reserved_bytes``: the allocator's fragmentation is their difference): sampling with
#: scoring, and each training micro-batch, so preflight's generation and training phases are checked apart
PEAK_PHASES = ("_generate_and_score_completions", "training_step")
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3
PROMPT_WORDS = 32
GiB = 2**30

# Qwen2.5-like shapes (public config values); weights are random.
POLICIES: dict[str, dict[str, Any]] = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}
REWARD_MODEL = {"0.5b": "0.5b", "1.5b": "0.5b", "tiny": "tiny"}  # reward model shape per policy


#: Hopper ceilings: the bf16 matmul rate measured on these machines (788 TFLOP/s on an H200, 798 on an H100, an
#: 8192^3 product), and the HBM bandwidth of the datasheet per device (a device copy moved ~4.3 and ~3.0 TB/s).
PEAK_BF16_FLOPS = 790e12
HBM_BYTES_PER_S = 4.8e12  # H200; the default where the device is not known
_HBM_BY_DEVICE = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bytes_per_s(device: str | None) -> float:
    """The HBM bandwidth of the floor for ``device`` (a CUDA device name): an H100's decode reads take 1.4x an
    H200's. Unknown names get the H200's."""
    return next((bw for name, bw in _HBM_BY_DEVICE.items() if name in (device or "")), HBM_BYTES_PER_S)


def floor_estimate(policy: str, batch: int, prompt_len: int, completion_len: int, grad_ckpt: bool,
                   dtype_bytes: int = 2, group: int = 1, hbm: float = HBM_BYTES_PER_S) -> dict[str, float]:
    """The least time one GRPO step on one GPU can take, from the model shapes: the matmul FLOPs of the
    prefill (once per distinct prompt: ``group`` completions share one), the reward model's forward, the loss's
    forward, the checkpointed recomputation and the backward (activation gradients only: the base is frozen,
    LoRA's own are ~1% more) at the bf16 rate, plus ``completion_len`` decode steps, each at least one read of
    every weight and of the KV cache (or its FLOPs, whichever is larger). Attention score FLOPs included;
    elementwise work is not."""
    def shape(name):
        c = POLICIES[name]
        h, inter, layers, heads, kv = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                                       c["num_attention_heads"], c["num_key_value_heads"])
        hd = h // heads
        linear = layers * (h * h * 2 + 2 * h * kv * hd + 3 * h * inter)  # q, o, k, v, gate, up, down
        return dict(linear=linear, head=h * c["vocab_size"], layers=layers, q=heads * hd, kvdim=kv * hd,
                    weights=(linear + h * c["vocab_size"] + layers * 2 * h) * dtype_bytes)

    pol, rm = shape(policy), shape(REWARD_MODEL[policy])
    seq = prompt_len + completion_len
    tokens = batch * seq

    def fwd(m, n_tokens, ctx, head_tokens):  # matmul FLOPs of one forward over n_tokens (mean context ctx)
        return 2 * m["linear"] * n_tokens + 4 * m["layers"] * m["q"] * ctx * n_tokens + 2 * m["head"] * head_tokens

    prefill = fwd(pol, batch // group * prompt_len, prompt_len / 2, batch // group)
    reward = fwd(rm, tokens, seq / 2, 0)  # a 1-label score head: negligible
    loss_fwd = fwd(pol, tokens, seq / 2, batch * completion_len)  # TRL's fused head: completion positions only
    passes = 3 if grad_ckpt else 2  # forward, (recompute), backward to the activations
    compute_s = (prefill + reward + passes * loss_fwd) / PEAK_BF16_FLOPS
    kv_bytes = 2 * pol["layers"] * pol["kvdim"] * dtype_bytes * batch * (seq / 2)  # mean cache filled
    step_bytes = pol["weights"] + kv_bytes
    step_flops = fwd(pol, batch, seq / 2, batch)
    decode_s = completion_len * max(step_bytes / hbm, step_flops / PEAK_BF16_FLOPS)
    return {"floor_s": compute_s + decode_s, "floor_compute_s": compute_s, "floor_decode_s": decode_s,
            # the phases' own floors: sampling (prefill + decode), the reward model, the training passes
            "floor_generate_s": prefill / PEAK_BF16_FLOPS + decode_s, "floor_rewards_s": reward / PEAK_BF16_FLOPS,
            "floor_training_s": passes * loss_fwd / PEAK_BF16_FLOPS,
            "floor_flops": prefill + reward + passes * loss_fwd + completion_len * step_flops,
            "floor_decode_bytes": completion_len * step_bytes, "prompt_len": prompt_len}


def step_floor(policy: str, completions: int, generation_batch: int, prompt_len: int, completion_len: int,
               grad_ckpt: bool, group: int = 1, device: str | None = None) -> dict[str, float]:
    """``floor_estimate`` for an optimizer step of ``completions`` per rank generated ``generation_batch`` at a
    time: the step's FLOPs do not depend on the layout, its decode reads repeat once per generation round
    (``completions / generation_batch`` rounds), so a smaller generation batch has a higher floor."""
    one = floor_estimate(policy, generation_batch, prompt_len, completion_len, grad_ckpt, group=group,
                         hbm=hbm_bytes_per_s(device))
    rounds = completions / generation_batch
    return {k: (v * rounds if k != "prompt_len" else v) for k, v in one.items()}


def log(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=list(POLICIES), default="0.5b")
    p.add_argument("--variants", default="stock,patched-local,patched-main",
                   help="comma-separated, run in this order each round: " + ",".join(VARIANTS))
    p.add_argument("--grad-ckpt", choices=["on", "off"], default="on")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per variant")
    p.add_argument("--rounds", type=int, default=1, help="repeat the variant cycle; timings pooled")
    p.add_argument("--per-device-batch", type=int, default=8,
                   help="completions per device per micro-batch (per_device_train_batch_size)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (micro-batches per step)")
    p.add_argument("--steps-per-generation", type=int, default=None,
                   help="micro-batches per generation round (default: TRL's, = --grad-accum)")
    p.add_argument("--grid", action="store_true",
                   help="driver: for each of --grid-variants, every micro-batch x generation batch at "
                        "--completions-per-step (whole groups per round, no sampling ahead of the optimizer), each a "
                        "fresh launch of --nproc ranks under --mem-cap-gb; prints tokens/s and the floor multiple per row")
    p.add_argument("--completions-per-step", type=int, default=1024,
                   help="--grid: completions per device per optimizer step, kept by every row")
    p.add_argument("--grid-variants", default="stock,patched-speed", help="--grid: variants compared")
    p.add_argument("--grid-micro-batches", default=None,
                   help="--grid: comma-separated micro-batches (default: the powers of two dividing "
                        "--completions-per-step, from --num-generations / 2 up)")
    p.add_argument("--grid-generation-batches", default=None,
                   help="--grid: comma-separated generation batches per device kept (default: all)")
    p.add_argument("--dry-run", action="store_true", help="--grid: list the grid, its floors and commands; run nothing")
    p.add_argument("--grid-all", action="store_true",
                   help="--grid: also launch rows that grpo_patches.preflight predicts do not fit under --mem-cap-gb")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--reward-chunk-size", type=int, default=None, help="patched variants' reward_chunk_size")
    p.add_argument("--mem-cap-gb", type=float, default=None,
                   help="cap each GPU with torch.cuda.set_per_process_memory_fraction(cap / total)")
    p.add_argument("--find-max-batch", action="store_true",
                   help="driver: double then bisect the per-device batch per variant, each probe a fresh "
                        "launch of --nproc ranks (run this without a launcher)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per probe with --find-max-batch")
    p.add_argument("--max-batch-limit", type=int, default=256, help="largest per-device batch probed")
    p.add_argument("--start-batch", type=int, default=None, help="first probe (default: --num-generations)")
    p.add_argument("--bisect-step", type=int, default=None,
                   help="stop bisecting when the bracket is this narrow (default: --num-generations)")
    p.add_argument("--probe-timeout", type=float, default=900.0, help="seconds per probe launch")
    p.add_argument("--probe-steps", type=int, default=2,
                   help="steps per probe; the last one's tokens/s is the throughput at the largest batch")
    p.add_argument("--no-bisect", action="store_true",
                   help="--find-max-batch: probe only the doubling sequence from --start-batch (no bisection after a "
                        "failure), e.g. --start-batch 208 --max-batch-limit 208 --no-bisect for one probe at 208")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # a probe launched by the driver
    p.add_argument("--report-only", action="store_true",
                   help="merge per-rank parts left by an interrupted run into results.jsonl and rewrite "
                        "results.md and the plots (no training); with --grid: print the grid's tables, each "
                        "phase against its floor, from --out's grid.jsonl and grid/results.jsonl")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="weights of the policy and reward model (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="default: benchmarks/results/<date>-<gpu>/")
    p.add_argument("--tag", default="", help="free text stored with every record")
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    round_size = args.per_device_batch * (args.steps_per_generation or args.grad_accum)
    if round_size % args.num_generations:
        p.error(f"--per-device-batch {args.per_device_batch} x steps per generation must be a multiple of "
                f"--num-generations {args.num_generations} (the patched trainer refuses group-splitting shapes)")
    bad = [v for v in args.grid_variants.split(",") if v.strip() and v.strip() not in VARIANTS]
    if args.grid and bad:
        p.error(f"unknown --grid-variants {bad}; choose from {list(VARIANTS)}")
    return args


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_out_dir() -> Path:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
    return ROOT / "benchmarks" / "results" / f"{_dt.date.today().isoformat()}-{slug}"


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` ids: ``t<id>`` words, so every id decodes to one word
    and re-encodes to one token (the reward model sees as many tokens as were generated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        model_input_names=["input_ids", "attention_mask"],
    )


def model_config(policy: str, **extra: Any):
    from transformers import Qwen2Config

    return Qwen2Config(**POLICIES[policy], max_position_embeddings=32768, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, **extra)


def build_templates(args, device, dtype):
    """Policy and reward model with random weights, built once per process under a fixed seed (on the
    GPU for speed) and kept on the CPU; each variant gets deep copies, so every variant trains the
    same weights and the templates hold no GPU memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(args.seed)
    with torch.device(device):
        policy = AutoModelForCausalLM.from_config(model_config(args.policy), dtype=dtype)
    policy = policy.to("cpu")
    policy.generation_config.pad_token_id = 0
    policy.generation_config.eos_token_id = 1
    policy.generation_config.bos_token_id = 2
    torch.manual_seed(args.seed + 1)
    rm_config = model_config(REWARD_MODEL[args.policy], num_labels=1)
    rm_config._name_or_path = f"reward-model-{REWARD_MODEL[args.policy]}"
    with torch.device(device):
        reward_model = AutoModelForSequenceClassification.from_config(rm_config, dtype=dtype)
    reward_model = reward_model.to("cpu").eval()
    return policy, reward_model


def build_dataset(args, world_size: int, vocab_size: int):
    from datasets import Dataset

    prompts_per_step = max(1, args.per_device_batch * args.grad_accum * world_size // args.num_generations)
    n_rows = max(64, 2 * prompts_per_step * (args.warmup + args.steps) * args.rounds)
    rng = random.Random(args.seed)
    rows = [{"prompt": " ".join(f"t{rng.randrange(len(SPECIAL), vocab_size)}" for _ in range(PROMPT_WORDS))}
            for _ in range(n_rows)]
    return Dataset.from_list(rows)


def rule_reward(completions, **kwargs):
    """Rule reward: share of even token ids among the completion's words (cheap, deterministic)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return out


# ----------------------------------------------------------------------------------------- timing


_TRACING: list[str] = []  # the method whose trace or kernel table is being recorded (torch.profiler does not nest)


class StepTimer:
    """TrainerCallback + method wrappers: per-step wall time and phase times, CUDA-synchronized."""

    def __init__(self, cuda: bool, rank: int, label: str, total_steps: int, warmup: int = 0):
        import torch

        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.rank, self.label, self.total, self.warmup = rank, label, total_steps, warmup
        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] | None = None
        self.last_begin: float | None = None
        self.cuda = cuda
        self.phase_sync = os.environ.get("BENCH_SYNC") != "step"  # step: only the steps' ends wait for the device
        self.peak = 0  # the run's peak allocated bytes, folded in before each phase's reset of the counter
        self._gc_t0 = 0.0
        # BENCH_TRACE=step: the first timed step's timeline ([] until it starts, then [profiler, region])
        self.step_trace: list | None = [] if "step" in os.environ.get("BENCH_TRACE", "").split(",") else None
        gc.callbacks.append(self._gc)  # the collector's pauses inside each step (gc_s, gc_full)

    def trace_activities(self) -> list:
        """What a timeline records: the host, and the device where there is one."""
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])

    def write_trace(self, prof, directory: str, name: str) -> None:
        """``prof``'s timeline as ``<directory>/trace-<name>-<variant>-rank<r>.json.gz``."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        raw = Path(directory) / f"trace-{name}-{self.label.replace('#', '_')}-rank{self.rank}.json"
        prof.export_chrome_trace(str(raw))
        subprocess.run(["gzip", "-f", str(raw)], check=False)

    def start_step_trace(self) -> None:
        """``BENCH_TRACE=step``: a host + device timeline of the first timed step, all of it (the phases' own
        traces skip their calls inside it: torch.profiler does not nest)."""
        import torch
        from torch.profiler import profile

        prof = profile(activities=self.trace_activities())
        prof.__enter__()
        region = torch.profiler.record_function("bench/step")
        region.__enter__()
        self.step_trace.extend([prof, region])
        _TRACING.append("step")

    def stop_step_trace(self) -> None:
        prof, region = self.step_trace
        region.__exit__(None, None, None)
        prof.__exit__(None, None, None)
        _TRACING.clear()
        self.write_trace(prof, os.environ.get("BENCH_PROFILE_DIR", "."), "step")

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self.cur is not None:
            self.cur["gc_s"] = self.cur.get("gc_s", 0.0) + time.perf_counter() - self._gc_t0
            if info.get("generation") == 2:
                self.cur["gc_full"] = self.cur.get("gc_full", 0) + 1

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Cb(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.sync()
                if (timer.step_trace is not None and not timer.step_trace and not _TRACING
                        and len(timer.steps) >= timer.warmup):
                    timer.start_step_trace()
                now = time.perf_counter()
                if timer.steps and timer.last_begin is not None:
                    timer.steps[-1]["cycle_s"] = now - timer.last_begin  # begin to next begin (with logging)
                timer.last_begin = now
                timer.cur = {"t0": now}

            def on_step_end(self, args, state, control, **kwargs):
                timer.sync()
                cur = timer.cur
                if cur is None:
                    return
                cur["step_s"] = time.perf_counter() - cur.pop("t0")
                if timer.step_trace and _TRACING == ["step"]:
                    timer.stop_step_trace()
                if os.environ.get("BENCH_ALTERNATE_OVERLAP") == "1":
                    cur["overlap_mode"] = OVERLAP_MODES.index(_OVERLAP[0])
                    _OVERLAP[0] = OVERLAP_MODES[(len(timer.steps) + 1) % len(OVERLAP_MODES)]
                timer.steps.append(cur)
                timer.cur = None
                d = derive(cur)
                mode = f" [{OVERLAP_MODES[cur['overlap_mode']]}]" if "overlap_mode" in cur else ""
                log(f"  {timer.label}{mode} step {len(timer.steps)}/{timer.total}: {cur['step_s']:.2f} s "
                    f"(generate {d['generate_s']:.2f}, rewards {d['rewards_s']:.3f}, "
                    f"loss/backward {d['loss_backward_s']:.2f}; gc {d['gc_s']:.2f} ({d['gc_full']} full); "
                    f"{int(cur.get('completion_tokens', 0))} tokens"
                    + "".join(f"; {d[k]} {k.replace('_', ' ')}" for k in ("sample_alloc_retries", "train_alloc_retries")
                              if d[k]) + ")", timer.rank)
                if os.environ.get("BENCH_GC_FREEZE") == "1" and len(timer.steps) == timer.warmup:
                    gc.collect()
                    gc.freeze()  # what the warm-up built (compiled graphs, captures) is never scanned again

        return _Cb()

    def wrap(self, trainer, name: str, count_tokens: bool = False) -> None:
        original = getattr(trainer, name)  # bound (possibly the patch's wrapt wrapper)
        timer = self

        profile_to = os.environ.get("BENCH_PROFILE_DIR") if os.environ.get("BENCH_PROFILE") == name else None
        profiler = None
        if profile_to:  # cProfile of this one method, cumulative over the timed steps
            import cProfile

            profiler = cProfile.Profile()

        import torch

        kernels_to = (os.environ.get("BENCH_PROFILE_DIR") if name in os.environ.get("BENCH_KERNELS", "").split(",")
                      and torch.cuda.is_available() else None)  # kernels: CUDA only
        trace_to = (os.environ.get("BENCH_PROFILE_DIR")
                    if name in os.environ.get("BENCH_TRACE", "").split(",") else None)
        stacks = name in os.environ.get("BENCH_TRACE_STACK", "").split(",")
        traced = []  # one trace: the first timed call's

        phase_peak = timer.cuda and name in PEAK_PHASES

        def timed(*a, **kw):
            if timer.phase_sync:
                timer.sync()
            if phase_peak:  # this phase's own peak; the run's peak is kept in timer.peak
                timer.peak = max(timer.peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
                retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            per_call = name == "training_step"  # each micro-batch's wall time and cudaMalloc calls
            mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) if per_call and timer.cuda else 0
            t0 = time.perf_counter()
            profiling = profiler is not None and len(timer.steps) >= timer.warmup  # timed steps only
            if profiling:
                profiler.enable()
            # one timed call, never inside another's trace (torch.profiler does not nest); a training step
            # after this step's sampling, so that its trace is of training alone
            tracing = (trace_to and not traced and not _TRACING and len(timer.steps) >= timer.warmup
                       and (name != "training_step" or "_generate" in (timer.cur or {})))
            if tracing:  # host and device timeline of one timed call
                from torch.profiler import profile

                traced.append(True)
                _TRACING.append(name)
                with profile(activities=timer.trace_activities(), with_stack=stacks) as prof:
                    with torch.profiler.record_function(f"bench/{name}"):
                        out = original(*a, **kw)
                    timer.sync()
                _TRACING.clear()
                timer.write_trace(prof, trace_to, name)
            elif kernels_to and not _TRACING:  # the device kernels of each call; the last call's table is kept
                from torch.profiler import ProfilerActivity, profile

                _TRACING.append(name)  # a call inside this one (sampling inside a training step) runs unprofiled
                try:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        out = original(*a, **kw)
                        timer.sync()
                finally:
                    _TRACING.clear()
                Path(kernels_to).mkdir(parents=True, exist_ok=True)
                (Path(kernels_to) / f"kernels-{name}-{timer.label.replace('#', '_')}-rank{timer.rank}.json").write_text(
                    json.dumps(kernel_table(prof.events(), 1), indent=2))
            else:
                with torch.profiler.record_function(f"bench/{name}"):  # a label in any outer trace
                    out = original(*a, **kw)
            if timer.phase_sync:
                timer.sync()
            if profiling:
                import io
                import pstats

                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(70)
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                Path(profile_to).mkdir(parents=True, exist_ok=True)
                (Path(profile_to) / f"profile-{timer.label.replace('#', '_')}-rank{timer.rank}.txt").write_text(
                    text.getvalue())
            if timer.cur is not None:
                elapsed = time.perf_counter() - t0
                timer.cur[name] = timer.cur.get(name, 0.0) + elapsed
                if per_call:
                    timer.cur.setdefault("training_step_calls", []).append(round(elapsed, 4))
                    if timer.cuda:
                        timer.cur.setdefault("training_step_mallocs", []).append(
                            torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs)
                if phase_peak:  # allocated (what preflight predicts) and reserved (with the allocator's slack)
                    key, reserved = f"{name}_peak_bytes", f"{name}_reserved_bytes"
                    timer.cur[key] = max(timer.cur.get(key, 0), torch.cuda.max_memory_allocated())
                    timer.cur[reserved] = max(timer.cur.get(reserved, 0), torch.cuda.max_memory_reserved())
                    # the allocator freed its cache and retried (a synchronizing cudaFree): time at the memory cap
                    key = f"{name}_alloc_retries"
                    timer.cur[key] = timer.cur.get(key, 0) + torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
                if count_tokens:  # _generate returns (prompt_ids, completion_ids, ...), lists of id lists
                    timer.cur["completion_tokens"] = timer.cur.get("completion_tokens", 0) + sum(
                        len(ids) for ids in out[1])
            if phase_peak:  # reset again: a training step that sampled counts only what came after
                timer.peak = max(timer.peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            return out

        setattr(trainer, name, timed)  # instance attribute: this trainer only

    def instrument(self, trainer) -> None:
        self.wrap(trainer, "_generate", count_tokens=True)
        self.wrap(trainer, "_calculate_rewards")
        self.wrap(trainer, "_generate_and_score_completions")
        self.wrap(trainer, "_prepare_inputs")
        self.wrap(trainer, "training_step")


def kernel_kind(name: str) -> str:
    """A CUDA kernel's kind, from its name (cuBLAS / cuDNN / ATen / inductor naming)."""
    n = name.lower()
    if any(k in n for k in ("gemm", "gemv", "cutlass", "xmma", "splitk", "cublas", "nvjet")):
        return "matmul"
    if any(k in n for k in ("fmha", "flash", "attention", "flex")):
        return "attention"
    if n.startswith("triton"):
        return "triton (inductor fused)"
    if "memcpy" in n or "memset" in n or "copy" in n or "cat" in n:
        return "copy / cat"
    if any(k in n for k in ("reduce", "softmax", "norm", "sum", "max", "argmax")):
        return "reduction"
    if "elementwise" in n:
        return "elementwise"
    return "other"


def kernel_table(events, steps: int, top: int = 25) -> dict:
    """Device time by kernel and kind from torch.profiler events (CUDA ones only), per ``steps``."""
    import torch

    kernels: dict[str, list] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    kinds: dict[str, float] = {}
    for name, (_, us) in ranked:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / steps / 1e3
    return {"steps": steps, "kernel_ms_per_step": sum(us for _, (_, us) in ranked) / steps / 1e3,
            "launches_per_step": sum(n for _, (n, _) in ranked) / steps, "by_kind_ms_per_step": kinds,
            "top": [{"kernel": name[:120], "per_step": n / steps, "ms_per_step": us / steps / 1e3}
                    for name, (n, us) in ranked[:top]]}


def derive(step: dict[str, float]) -> dict[str, float]:
    gen = step.get("_generate", 0.0)
    rew = step.get("_calculate_rewards", 0.0)
    gas = step.get("_generate_and_score_completions", 0.0)
    prep = step.get("_prepare_inputs", 0.0)
    ts = step.get("training_step", 0.0)
    total = step.get("step_s", 0.0)
    return {
        "step_s": total,
        "cycle_s": step.get("cycle_s"),  # step begin to next step begin (incl. logging)
        "generate_s": gen,
        "rewards_s": rew,
        "score_other_s": max(gas - gen - rew, 0.0),
        "prepare_other_s": max(prep - gas, 0.0),
        "loss_backward_s": max(ts - prep, 0.0),
        "other_s": max(total - ts, 0.0),
        "completion_tokens": step.get("completion_tokens", 0.0),
        "tokens_per_s": step.get("completion_tokens", 0.0) / total if total else 0.0,
        "sample_peak_gib": step.get("_generate_and_score_completions_peak_bytes", 0) / GiB or None,
        "train_peak_gib": step.get("training_step_peak_bytes", 0) / GiB or None,
        "sample_reserved_gib": step.get("_generate_and_score_completions_reserved_bytes", 0) / GiB or None,
        "train_reserved_gib": step.get("training_step_reserved_bytes", 0) / GiB or None,
        "sample_alloc_retries": step.get("_generate_and_score_completions_alloc_retries"),
        "train_alloc_retries": step.get("training_step_alloc_retries"),
        "gc_s": step.get("gc_s", 0.0),  # Python's collector, anywhere in the step
        "gc_full": step.get("gc_full", 0),  # of it, full (generation 2) collections
        **({"overlap_mode": step["overlap_mode"]} if "overlap_mode" in step else {}),  # BENCH_ALTERNATE_OVERLAP
        "train_calls_s": step.get("training_step_calls"),  # per micro-batch (the first one's sampling included)
        "train_calls_mallocs": step.get("training_step_mallocs"),
    }


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"median": statistics.median(s), "mean": statistics.fmean(s), "min": s[0], "max": s[-1],
            "p25": q[0], "p75": q[2], "stdev": statistics.stdev(s) if len(s) > 1 else 0.0}


# ---------------------------------------------------------------------------------------- variants


def run_variant(args, variant: str, round_idx: int, ctx: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import set_seed
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo_patches
    from grpo_patches.defaults import lora_config

    rank, world, cuda = ctx["rank"], ctx["world_size"], ctx["cuda"]
    test_oom = os.environ.get("BENCH_TEST_OOM_ABOVE")  # CPU test hook for --find-max-batch
    if test_oom and args.per_device_batch > int(test_oom):
        raise RuntimeError(f"BENCH_TEST_OOM_ABOVE={test_oom}: simulated out of memory")
    free_memory(cuda)
    base_alloc = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
    options, config_overrides = VARIANTS[variant]
    if os.environ.get("BENCH_REWARD_MODEL_ROWS"):  # the kit's reward-model forward size (0: the whole batch)
        from grpo_patches import rewards

        rewards.REWARD_MODEL_ROWS = int(os.environ["BENCH_REWARD_MODEL_ROWS"])
    if os.environ.get("BENCH_SHARED_PROMPT") == "0":  # every row's decode attention reads its own prompt slots
        from grpo_patches.generation import fused_loop

        fused_loop.SHARE_PROMPT = False
    if os.environ.get("BENCH_FUSED_DROPOUT") == "0":  # lean LoRA layers with PEFT's dropout and lora_A
        from grpo_patches import lora_dropout

        lora_dropout._AVAILABLE = False
    if os.environ.get("BENCH_DROPOUT_TILES"):  # the fused dropout's tiles (lora_dropout.TILES, as JSON)
        from grpo_patches import lora_dropout

        lora_dropout.TILES = tuple((b, tuple(f), tuple(g)) for b, f, g in json.loads(os.environ["BENCH_DROPOUT_TILES"]))
    if os.environ.get("BENCH_FUSED_GATE_UP") == "0":  # compile_training with PEFT's own gate and up projections
        from grpo_patches import fused_gate_up

        fused_gate_up._fused = lambda mlp, x: None
    if os.environ.get("BENCH_DOWN_LAST") == "0":  # compile_training with the down projection inside the graph
        from grpo_patches import recompute_tail

        recompute_tail.down_projection = lambda down, adapter, h: down(h)
    if os.environ.get("BENCH_PICK") == "gumbel":  # the fused step's pick before the inverse-CDF sample
        from benchmarks.compiled_rng import gumbel_pick
        from grpo_patches.generation import decode, fused_loop

        fused_loop.pick = decode._pick = gumbel_pick
    if os.environ.get("BENCH_KEEP_CACHE") == "1":  # the capture empties the cache only where its pool does not fit
        from grpo_patches.generation import fused_loop

        room = fused_loop._room
        fused_loop._room = lambda: (room()[0], 0)
    if os.environ.get("BENCH_ALTERNATE_OVERLAP") == "1":  # grpo_patches/overlap.py's pieces step by step
        _alternate_overlap()
    if os.environ.get("BENCH_CAPTURE_SYNC") == "1":  # the device waited for before the graph is recorded
        _capture_after_waiting()
    if os.environ.get("BENCH_PREFILL_ALL") == "1":  # every row prefilled, repeated prompts too
        from grpo_patches.generation import decode

        decode.repeated_rows = lambda input_ids, attention_mask: None
    placement = options and options["reward_placement"]
    if options is None:
        grpo_patches.revert()
    else:
        grpo_patches.revert()  # apply() options differ between variants
        grpo_patches.apply(reward_chunk_size=args.reward_chunk_size, **options)
    set_seed(args.seed)
    policy = copy.deepcopy(ctx["policy_template"])
    reward_model = copy.deepcopy(ctx["rm_template"])
    total_steps = args.warmup + args.steps
    config = GRPOConfig(
        output_dir=ctx["tmpdir"], per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum,
        **({"steps_per_generation": args.steps_per_generation} if args.steps_per_generation else {}),
        num_generations=args.num_generations, max_completion_length=args.completion_len,
        max_steps=total_steps, gradient_checkpointing=args.grad_ckpt == "on",
        bf16=cuda, use_cpu=not cuda, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=args.seed, dataloader_num_workers=0, **config_overrides,
        # BENCH_NAN_FILTER=0: the Trainer's check of each micro-batch's loss for NaN / inf (a device wait
        # between micro-batches) off
        **({"logging_nan_inf_filter": False} if os.environ.get("BENCH_NAN_FILTER") == "0" else {}),
    )
    lora = lora_config()  # the kit's pinned LoRA: r16, alpha 32, dropout 0.05, all seven projections
    label = f"{variant}#{round_idx}"
    timer = StepTimer(cuda, rank, label, total_steps, args.warmup)
    t_build = time.perf_counter()
    trainer = GRPOTrainer(
        model=policy, reward_funcs=[rule_reward, reward_model], args=config, train_dataset=ctx["dataset"],
        processing_class=ctx["tokenizer"], reward_processing_classes=[None, ctx["tokenizer"]],
        peft_config=lora, callbacks=[timer.callback()],
    )
    del policy, reward_model  # the trainer holds what it uses
    if os.environ.get("BENCH_OVERLAP") == "1" or os.environ.get("BENCH_ALTERNATE_OVERLAP") == "1":
        from grpo_patches.overlap import enable_overlap

        enable_overlap(trainer)
    if variant == "stock-graph":
        from grpo_patches.targets.trl_generation import enable_fast_generation

        enable_fast_generation(trainer, {"decode_loop": "graph"})
    trainer.remove_callback(PrinterCallback)  # no dump of every log dict
    rm_local = any(isinstance(f, torch.nn.Module) for f in trainer.reward_funcs)
    distributed = str(trainer.accelerator.distributed_type).split(".")[-1]  # NO / MULTI_GPU / FSDP / ...
    timer.instrument(trainer)
    if os.environ.get("BENCH_PLAIN_LAYERS"):
        _plain_layers(trainer.model, int(os.environ["BENCH_PLAIN_LAYERS"]), rank)
    build_s = time.perf_counter() - t_build
    from torch._dynamo.utils import counters

    graphs_before = int(counters["stats"]["unique_graphs"])
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    graphs = int(counters["stats"]["unique_graphs"]) - graphs_before  # decode step and compiled layers (if any)
    mem: dict[str, Any] = {}
    if cuda:
        torch.cuda.synchronize()
        mem = {"peak_allocated_bytes": max(timer.peak, torch.cuda.max_memory_allocated()),
               "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
               "base_allocated_bytes": base_alloc}
        stats = torch.cuda.memory_stats()  # over the whole run: warm-up and timed steps
        mem["allocator"] = {"alloc_retries": stats.get("num_alloc_retries"), "ooms": stats.get("num_ooms"),
                            "cuda_mallocs": stats.get("num_device_alloc"), "cuda_frees": stats.get("num_device_free"),
                            "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    from grpo_patches.generation import FAST_GEN_ATTR

    fast_state = getattr(trainer, FAST_GEN_ATTR, None)  # the kit's counters (captures, capture seconds, ...)
    fast_state = fast_state.summary() if fast_state is not None else None
    trainer.accelerator.free_memory()  # drops accelerate's references to the model and optimizer
    alive = weakref.ref(trainer)
    del trainer
    free_memory(cuda)
    mem["trainer_freed"] = alive() is None  # else the next variant's memory starts from this one's
    if cuda:
        mem["after_allocated_bytes"] = torch.cuda.memory_allocated()

    gc.callbacks.remove(timer._gc)  # the next variant's timer counts its own
    timed = timer.steps[args.warmup:]
    derived = [derive(s) for s in timed]
    summary = ({key: summarize([d[key] for d in derived if d[key] is not None]) for key in derived[0]
                if not isinstance(derived[0][key], list)} if derived else {})
    return {
        "variant": variant, "round": round_idx, "rank": rank, "world_size": world,
        "reward_placement": placement, "reward_model_on_this_rank": rm_local, "distributed": distributed,
        "fast_generation": bool(options and options.get("fast_generation")) or variant == "stock-graph",
        "config_overrides": config_overrides, "fast_generation_state": fast_state,
        "build_s": build_s, "train_s": train_s, "dynamo_graphs": graphs, "steps_recorded": len(timer.steps),
        "phase_sync": timer.phase_sync,  # False: the phase times are the host's
        "warmup_steps": [derive(s) for s in timer.steps[: args.warmup]],
        "timed_steps": derived, "summary": summary, "trainable_params": trainable, **mem,
        "floor": step_floor(args.policy, args.per_device_batch * args.grad_accum,
                            args.per_device_batch * (args.steps_per_generation or args.grad_accum),
                            ctx["prompt_tokens"], args.completion_len, args.grad_ckpt == "on", args.num_generations,
                            torch.cuda.get_device_name() if cuda else None),
    }


def _plain_layers(model, n: int, rank: int) -> None:
    """``BENCH_PLAIN_LAYERS=n``: the last ``n`` decoder layers without gradient checkpointing, also after TRL turns it
    off for sampling and on again (``disable_gradient_checkpointing``): each model's ``_set_gradient_checkpointing``
    leaves them off once it has run."""
    from transformers import PreTrainedModel

    from grpo_patches.compiled_training import decoder_layers

    every = decoder_layers(model)
    layers = every[-n:] if n else []

    def wrapped(original):
        def set_checkpointing(*args, **kwargs):
            original(*args, **kwargs)
            for layer in layers:
                layer.gradient_checkpointing = False
        return set_checkpointing

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module._set_gradient_checkpointing = wrapped(module._set_gradient_checkpointing)
    for layer in layers:
        layer.gradient_checkpointing = False
    log(f"the last {len(layers)} of {len(every)} decoder layers without checkpointing", rank)


#: BENCH_ALTERNATE_OVERLAP=1: the steps of one run cycle through these (``overlap_mode`` in each step's record
#: is the index): both of ``grpo_patches/overlap.py``'s pieces, neither, the loss filter alone
OVERLAP_MODES = ("both", "none", "filter")
_OVERLAP = [OVERLAP_MODES[0]]


def _alternate_overlap() -> None:
    """``grpo_patches/overlap.py``'s two pieces on or off per step (``OVERLAP_MODES``), so one process, one machine
    and one compiled model time them side by side (rows in separate processes differ by ~0.1 s on their own)."""
    import contextlib

    from grpo_patches import overlap

    filtered, mask_unread = overlap.filtered, overlap.mask_unread
    overlap.filtered = lambda trainer, loss: filtered(trainer, loss) if _OVERLAP[0] != "none" else loss
    overlap.mask_unread = lambda: mask_unread() if _OVERLAP[0] == "both" else contextlib.nullcontext()


def _capture_after_waiting() -> None:
    """``BENCH_CAPTURE_SYNC=1``: the fused loop's capture as it was before it recorded while the device still ran
    the prefill: it waits for the device after its real step, then empties the allocator's cache where less than
    the last pool or a quarter of the allowed memory is left (nothing is emptied before the prefill). The capture
    reads ``_room`` once, right after its real step, and empties the cache itself where the pool does not fit."""
    import torch

    from grpo_patches.generation import decode, fused_loop

    room = fused_loop._room

    def waited_room():
        torch.cuda.synchronize()
        left, allowed = room()
        if left < allowed // 4:
            torch.cuda.empty_cache()
            left, allowed = room()
        return left, allowed

    fused_loop._room = waited_room
    decode.make_room = lambda graphs, device, stats: None


def free_memory(cuda: bool) -> None:
    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def worker(args) -> int:
    """One rank: run every variant (alternating), write its records, rank 0 writes the reports."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "datasets", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch

    import grpo_patches  # noqa: F401  (fail early if the kit is not importable)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = gpu_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or (torch.bfloat16 if cuda else torch.float32)
    mem_total = None
    if cuda:
        torch.cuda.set_device(device)
        mem_total = torch.cuda.get_device_properties(device).total_memory
        if args.mem_cap_gb:
            fraction = min(1.0, args.mem_cap_gb * GiB / mem_total)  # "24 GB" read as 24 GiB (a 24 GB card)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
    out = Path(args.out) if args.out else default_out_dir()
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    run_id = os.environ.get("BENCH_RUN_ID") or f"{time.strftime('%Y%m%dT%H%M%S')}-w{world}"

    log(f"policy {args.policy}, {world} rank(s) on {torch.cuda.get_device_name(device) if cuda else 'CPU'}, "
        f"variants {args.variant_list} x {args.rounds} round(s), {args.warmup}+{args.steps} steps, "
        f"batch {args.per_device_batch}/device, {args.completion_len} tokens, grad ckpt {args.grad_ckpt}, "
        f"mem cap {args.mem_cap_gb} GB -> {out}", rank)
    t0 = time.perf_counter()
    policy_template, rm_template = build_templates(args, device, dtype)
    rm_bytes = sum(p.numel() * p.element_size() for p in rm_template.parameters())
    ctx = {
        "rank": rank, "world_size": world, "cuda": cuda,
        "policy_template": policy_template, "rm_template": rm_template,
        "tokenizer": build_tokenizer(POLICIES[args.policy]["vocab_size"]),
        "dataset": build_dataset(args, world, POLICIES[args.policy]["vocab_size"]),
        "tmpdir": tempfile.mkdtemp(prefix="bench_grpo_"),
    }
    ctx["prompt_tokens"] = len(ctx["tokenizer"](ctx["dataset"][0]["prompt"])["input_ids"])
    log(f"templates built in {time.perf_counter() - t0:.1f} s: policy "
        f"{sum(p.numel() for p in policy_template.parameters()) / 1e6:.1f} M params, reward model "
        f"{rm_bytes / GiB:.3f} GiB", rank)
    meta = {
        "run_id": run_id, "tag": args.tag, "policy": args.policy, "grad_ckpt": args.grad_ckpt,
        "per_device_batch": args.per_device_batch, "num_generations": args.num_generations,
        "grad_accum": args.grad_accum, "steps_per_generation": args.steps_per_generation,
        "completion_len": args.completion_len, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "mem_cap_gb": args.mem_cap_gb, "reward_chunk_size": args.reward_chunk_size,
        "reward_model_param_bytes": rm_bytes,
        "policy_params": sum(p.numel() for p in policy_template.parameters()),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "device_total_bytes": mem_total,
        "versions": versions(), "git": git_commit(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    part_file = parts / f"{run_id}.rank{rank}.jsonl"
    for r in range(args.rounds):
        for variant in args.variant_list:
            log(f"{variant} (round {r + 1}/{args.rounds}): building a fresh trainer", rank)
            rec = run_variant(args, variant, r, ctx)
            rec.update(meta)
            with open(part_file, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            s = rec["summary"].get("step_s", {})
            peak = rec.get("peak_allocated_bytes")
            log(f"{variant} done: median step {s.get('median', float('nan')):.2f} s, peak allocated "
                f"{(peak or 0) / GiB:.2f} GiB (rank 0), build {rec['build_s']:.1f} s, train "
                f"{rec['train_s']:.1f} s; elapsed {time.perf_counter() - t0:.0f} s; allocator "
                f"{rec.get('allocator')}; dynamo graphs {rec['dynamo_graphs']}; steps {[round(d.get('step_s') or 0, 2) for d in rec['timed_steps']]}", rank)
            fl = rec["floor"]
            log(f"{variant} floor: {fl['floor_s']:.3f} s per step ({fl['floor_flops'] / 1e12:.1f} TFLOP at "
                f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s, {fl['floor_decode_bytes'] / 1e9:.0f} GB of decode reads at "
                f"{hbm_bytes_per_s(rec.get('device')) / 1e12:.2f} TB/s); measured {s.get('median', float('nan')) / fl['floor_s']:.2f}x "
                f"the floor", rank)
            for r_ in range(world):  # every rank's memory, in rank order
                barrier(world)
                if r_ == rank and cuda:
                    print(f"[bench] rank {rank} {variant}: peak allocated {rec['peak_allocated_bytes'] / GiB:.2f} GiB,"
                          f" reserved {rec['peak_reserved_bytes'] / GiB:.2f} GiB, reward model on rank: "
                          f"{rec['reward_model_on_this_rank']}", flush=True)
    barrier(world)
    if rank == 0:
        merge_parts(out, sorted((out / "parts").glob(f"{run_id}.rank*.jsonl")))
        if not args.probe:
            write_reports(out)
        log(f"all done in {time.perf_counter() - t0:.0f} s; results in {out}", rank)
    barrier(world)
    return 0


def barrier(world: int) -> None:
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def merge_parts(out: Path, parts: list[Path]) -> int:
    """Append per-rank part files to results.jsonl; a merged part is renamed ``*.merged``."""
    n = 0
    with open(out / "results.jsonl", "a") as fh:
        for part in parts:
            for ln in part.read_text().splitlines():
                if ln.strip():
                    fh.write(ln + "\n")
                    n += 1
            part.rename(part.with_name(part.name + ".merged"))
    return n


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "trl", "transformers", "accelerate", "peft", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "?"
    return out


def git_commit() -> str | None:
    """HEAD, with ``+dirty`` when the tree differs from it (a copied tree, e.g. the device machine's,
    can carry an older HEAD than the code it runs)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    except Exception:
        return None


# ------------------------------------------------------------------------------------ max batch


def find_max_batch(args) -> int:
    """Driver: per variant, double the per-device batch from num_generations until a probe fails (or
    --max-batch-limit), then bisect in multiples of num_generations; every probe is a fresh launch of
    --nproc ranks that must complete 2 steps. Writes maxbatch.jsonl and regenerates the reports."""
    out = Path(args.out) if args.out else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    probe_out = out / "probes"
    ng = args.num_generations
    results = []
    for variant in args.variant_list:
        tried: dict[int, bool] = {}

        def probe(batch: int, variant: str = variant, tried: dict[int, bool] = tried) -> bool:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(args.nproc), str(Path(__file__).resolve()), "--probe", "--policy", args.policy,
                   "--variants", variant, "--grad-ckpt", args.grad_ckpt, "--steps", str(args.probe_steps), "--warmup", "0",
                   "--per-device-batch", str(batch), "--num-generations", str(ng),
                   "--completion-len", str(args.completion_len), "--seed", str(args.seed),
                   "--out", str(probe_out), "--tag", f"probe {variant} b{batch}"]
            if args.mem_cap_gb:
                cmd += ["--mem-cap-gb", str(args.mem_cap_gb)]
            if args.reward_chunk_size:
                cmd += ["--reward-chunk-size", str(args.reward_chunk_size)]
            env = dict(os.environ, BENCH_RUN_ID=f"probe-{variant}-b{batch}-{time.strftime('%H%M%S')}",
                       PYTHONUNBUFFERED="1")
            t0 = time.perf_counter()
            with tempfile.TemporaryFile("w+") as fh:
                ok = run_row(cmd, env, fh, args.probe_timeout)
                fh.seek(0)
                output = fh.read()
            oom = "out of memory" in output.lower() or "OutOfMemoryError" in output
            tried[batch] = ok
            log(f"probe {variant} batch {batch}: {'ok' if ok else 'FAILED' + (' (OOM)' if oom else '')} "
                f"in {time.perf_counter() - t0:.0f} s")
            if not ok:  # where it failed (the allocator's message says what was reserved and what was asked for)
                Path(probe_out).mkdir(parents=True, exist_ok=True)
                (Path(probe_out) / f"failed-{variant}-b{batch}.log").write_text(output[-20000:])
            if not ok and not oom:  # not a memory failure: show why (a bisect over it would be wrong)
                print(output[-3000:], flush=True)
            return ok

        lo, hi, batch = 0, None, args.start_batch or ng
        while batch <= args.max_batch_limit:
            if probe(batch):
                lo, batch = batch, batch * 2
            else:
                hi = batch
                break
        if hi is not None and not args.no_bisect:
            while hi - lo > max(ng, args.bisect_step or ng):
                mid = (lo + hi) // 2 // ng * ng
                if mid <= lo:
                    break
                if probe(mid):
                    lo = mid
                else:
                    hi = mid
        rec = {"variant": variant, "max_per_device_batch": lo, "first_failure": hi,
               "tokens_per_s_at_max": probe_throughput(probe_out, variant, lo), "probe_steps": args.probe_steps,
               **probe_floor(probe_out, variant, lo),
               "hit_limit": hi is None, "max_batch_limit": args.max_batch_limit, "probes": tried,
               "world_size": args.nproc, "policy": args.policy, "grad_ckpt": args.grad_ckpt,
               "completion_len": args.completion_len, "num_generations": ng, "mem_cap_gb": args.mem_cap_gb,
               "date": _dt.datetime.now().isoformat(timespec="seconds"), "versions": versions()}
        results.append(rec)
        log(f"{variant}: largest per-device batch {lo}" + (" (limit reached)" if hi is None else f", {hi} fails"))
        with open(out / "maxbatch.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")
    write_reports(out)
    return 0


def probe_floor(probe_out: Path, variant: str, batch: int) -> dict[str, float]:
    """The probe's step time after the first and its floor estimate (``floor_estimate``) at ``batch``."""
    recs = [r for r in load_jsonl(probe_out / "results.jsonl") if r.get("tag") == f"probe {variant} b{batch}"]
    if not recs or not recs[-1]["timed_steps"] or not recs[-1].get("floor"):
        return {}
    steps = recs[-1]["timed_steps"]
    steps = steps[1:] if len(steps) > 1 else steps
    step_s = statistics.median(s["step_s"] for s in steps)
    floor = recs[-1]["floor"]["floor_s"]
    return {"step_s_at_max": step_s, "floor_s_at_max": floor, "x_floor_at_max": step_s / floor}


def probe_throughput(probe_out: Path, variant: str, batch: int) -> float | None:
    """Completion tokens per second over the probe's steps after the first (rank 0's tokens / time,
    times its ranks): the first step of a fresh launch pays warm-up (and, with fast generation,
    compilation). With ``--probe-steps 2`` that is the last step alone."""
    recs = [r for r in load_jsonl(probe_out / "results.jsonl") if r.get("tag") == f"probe {variant} b{batch}"]
    if not recs or not recs[-1]["timed_steps"]:
        return None
    steps = recs[-1]["timed_steps"]
    steps = steps[1:] if len(steps) > 1 else steps
    seconds = sum(s["step_s"] for s in steps)
    return sum(s["completion_tokens"] for s in steps) / seconds * recs[-1]["world_size"] if seconds else None


# ------------------------------------------------------------------------------------------ grid


def grid_rows(args) -> list[dict[str, Any]]:
    """Every (variant, micro-batch b, generation round s) at ``--completions-per-step`` N per device: b divides
    N (accumulation a = N / b), s divides a (no round feeds two optimizer steps, so TRL computes no extra
    old-log-prob pass), b x s a multiple of ``--num-generations`` (whole groups per rank per round)."""
    n, ng = args.completions_per_step, args.num_generations
    micro = ([int(x) for x in args.grid_micro_batches.split(",")] if args.grid_micro_batches else
             [b for b in (2**k for k in range(n.bit_length())) if b >= max(1, ng // 2) and n % b == 0])
    keep = {int(x) for x in args.grid_generation_batches.split(",")} if args.grid_generation_batches else None
    rows = []
    for variant in [v.strip() for v in args.grid_variants.split(",") if v.strip()]:
        for b in micro:
            if n % b:
                raise SystemExit(f"--grid-micro-batches: {b} does not divide --completions-per-step {n}")
            a = n // b
            for steps in (d for d in range(1, a + 1) if a % d == 0):
                gen = b * steps
                if gen % ng or (keep is not None and gen not in keep):
                    continue
                rows.append({"variant": variant, "micro_batch": b, "grad_accum": a, "steps_per_generation": steps,
                             "generation_batch": gen, "tag": f"grid {variant} b{b} s{steps}"})
    return rows


def run_row(cmd: list[str], env: dict[str, str], log_file: Any, timeout: float) -> bool:
    """Run one grid row, its output into ``log_file``; True when it exits 0. At ``timeout`` the launcher gets
    SIGTERM, which it passes to its workers (they run in sessions of their own: a SIGKILL of the launcher leaves
    them running on the GPU under the next row), then its process group SIGKILL."""
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log_file.write(f"\ntimed out after --probe-timeout {timeout:g} s (the row's processes stopped)\n")
        return False


def grid_command(args, row: dict[str, Any], out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           str(Path(__file__).resolve()), "--probe", "--policy", args.policy, "--variants", row["variant"],
           "--grad-ckpt", args.grad_ckpt, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--per-device-batch", str(row["micro_batch"]), "--grad-accum", str(row["grad_accum"]),
           "--steps-per-generation", str(row["steps_per_generation"]), "--num-generations", str(args.num_generations),
           "--completion-len", str(args.completion_len), "--seed", str(args.seed), "--out", str(out),
           "--tag", row["tag"]]
    if args.mem_cap_gb:
        cmd += ["--mem-cap-gb", str(args.mem_cap_gb)]
    if args.reward_chunk_size:
        cmd += ["--reward-chunk-size", str(args.reward_chunk_size)]
    return cmd


def predicted_gib(args, row: dict[str, Any]) -> float:
    """``grpo_patches.preflight``'s peak for the row (GiB on rank 0, allocator only: the cap leaves the CUDA
    context out), with the variant's fast_generation / lean_lora / compile_training."""
    from grpo_patches.preflight import RewardModelSpec, preflight

    options, overrides = VARIANTS[row["variant"]]
    options = options or {}
    speed = bool(options.get("speed"))
    config = {"per_device_train_batch_size": row["micro_batch"], "gradient_accumulation_steps": row["grad_accum"],
              "steps_per_generation": row["steps_per_generation"], "num_generations": args.num_generations,
              "max_completion_length": args.completion_len, "gradient_checkpointing": args.grad_ckpt == "on",
              "temperature": overrides.get("temperature", 1.0), "top_p": overrides.get("top_p", 1.0)}  # GRPOConfig's
    report = preflight(model_config(args.policy), grpo_config=config, world_size=args.nproc,
                       reward_models=[RewardModelSpec(config=model_config(REWARD_MODEL[args.policy], num_labels=1))],
                       prompt_length=PROMPT_WORDS + 1, overhead_gb=0.0, fragmentation=0.0, raise_on_error=False,
                       warn=False, fast_generation=options.get("fast_generation", speed),
                       lean_lora=options.get("lean_lora", speed),
                       compile_training=options.get("compile_training", speed))
    return report.peak / GiB


def run_grid(args) -> int:
    """Driver: one fresh launch per grid row (``grid_rows``), each must finish ``--warmup`` + ``--steps`` steps;
    prints per row completion tokens/s over the timed steps, the step time, the step's floor (``step_floor``)
    and the multiple, and the best row per variant. ``--dry-run``: the rows, their floors and one command."""
    out = Path(args.out) if args.out else default_out_dir()
    runs = out / "grid"
    rows = grid_rows(args)
    prompt_len = PROMPT_WORDS + 1  # the worker measures it (one token per word and a BOS); the dry run assumes it
    for row in rows:
        fl = step_floor(args.policy, args.completions_per_step, row["generation_batch"], prompt_len,
                        args.completion_len, args.grad_ckpt == "on", args.num_generations)
        row["floor_s"] = fl["floor_s"]
        row["predicted_gib"] = predicted_gib(args, row)
        row["launch"] = args.grid_all or not args.mem_cap_gb or row["predicted_gib"] <= args.mem_cap_gb
    cap = f" under a {args.mem_cap_gb:g} GiB cap" if args.mem_cap_gb else ""
    log(f"grid: {len(rows)} rows, {args.completions_per_step} completions per device per step, policy {args.policy}, "
        f"{args.nproc} rank(s){cap}")
    if args.dry_run:
        print(f"{'variant':<16} {'micro':>5} {'accum':>5} {'steps/gen':>9} {'gen batch':>9} {'floor s':>8} "
              f"{'pred GiB':>8}  launch")
        for r in rows:
            print(f"{r['variant']:<16} {r['micro_batch']:>5} {r['grad_accum']:>5} {r['steps_per_generation']:>9} "
                  f"{r['generation_batch']:>9} {r['floor_s']:>8.3f} {r['predicted_gib']:>8.2f}  "
                  f"{'yes' if r['launch'] else 'no (predicted over the cap)'}")
        if rows:
            print("first command: " + " ".join(grid_command(args, rows[0], runs)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if not row["launch"]:
            row["status"] = f"skipped: predicted {row['predicted_gib']:.1f} GiB"
            continue
        env = dict(os.environ, BENCH_RUN_ID=f"grid-{row['tag'].replace(' ', '-')}-{time.strftime('%H%M%S')}",
                   PYTHONUNBUFFERED="1")
        runs.mkdir(parents=True, exist_ok=True)
        row_log = runs / f"log-{row['tag'].replace(' ', '-')}.txt"
        with open(row_log, "w") as fh:  # written as the row runs: a row or a driver killed from outside leaves its log
            ok = run_row(grid_command(args, row, runs), env, fh, args.probe_timeout)
        output = row_log.read_text(errors="replace")
        recs = [r for r in load_jsonl(runs / "results.jsonl") if r.get("tag") == row["tag"]]
        steps = recs[-1]["timed_steps"] if ok and recs else []
        if steps:
            seconds = sum(st["step_s"] for st in steps)
            row["tokens_per_s"] = sum(st["completion_tokens"] for st in steps) / seconds * recs[-1]["world_size"]
            row["step_s"] = statistics.median(st["step_s"] for st in steps)
            row["floor_s"] = recs[-1]["floor"]["floor_s"]  # with the measured prompt length
            row["x_floor"] = row["step_s"] / row["floor_s"]
            row["peak_gib"] = recs[-1].get("peak_allocated_bytes", 0) / GiB
            for key in ("sample_peak_gib", "train_peak_gib"):  # the phases' own peaks (CUDA only)
                row[key] = max((st.get(key) or 0 for st in steps), default=0) or None
        row["status"] = "ok" if steps else ("OOM" if "out of memory" in output.lower() else "failed")
        log(f"{row['tag']}: {row['status']}" + (f", {row['tokens_per_s']:.0f} tokens/s, {row['x_floor']:.2f}x the "
                                               f"floor" if steps else f" (floor {row['floor_s']:.3f} s)"))
        with open(out / "grid.jsonl", "a") as fh:
            fh.write(json.dumps({**row, "policy": args.policy, "completions_per_step": args.completions_per_step,
                                 "mem_cap_gb": args.mem_cap_gb, "world_size": args.nproc,
                                 "date": _dt.datetime.now().isoformat(timespec="seconds")}) + "\n")
    print(grid_table(rows))
    return 0


def grid_phase_table(out: Path) -> str:
    """Every grid run recorded under ``out`` (``grid/results.jsonl``): the median timed step's phases, each
    against its own floor (``floor_estimate``), and the warm-up steps (compilation, capture)."""
    lines = ["| run | step s (x floor) | sampling s (x floor) | reward model s (x floor) | training s (x floor) | "
             "other s | warm-up steps s |", "|---|---|---|---|---|---|---|"]
    for rec in load_jsonl(out / "grid" / "results.jsonl"):
        if not rec["timed_steps"]:
            continue
        fl = step_floor(rec["policy"], rec["per_device_batch"] * rec["grad_accum"],
                        rec["per_device_batch"] * (rec["steps_per_generation"] or rec["grad_accum"]),
                        rec["floor"]["prompt_len"], rec["completion_len"], rec["grad_ckpt"] == "on",
                        rec.get("num_generations", 1), rec.get("device"))
        groups: dict[str, list[dict]] = {}  # BENCH_ALTERNATE_OVERLAP: one line per overlap mode
        for st in rec["timed_steps"]:
            mode = st.get("overlap_mode")
            groups.setdefault("" if mode is None else f" [{OVERLAP_MODES[mode]}]", []).append(st)
        warm = ", ".join(f"{st['step_s']:.1f}" for st in rec.get("warmup_steps", []))
        for label, steps in groups.items():
            m = {k: statistics.median(st[k] for st in steps) for k in ("step_s", "generate_s", "rewards_s")}
            m["training_s"] = statistics.median(st["loss_backward_s"] for st in steps)
            m["other_s"] = statistics.median(st["score_other_s"] + st["prepare_other_s"] + st["other_s"]
                                             for st in steps)
            cell = {k: f"{m[k]:.2f} ({m[k] / fl[f'floor_{k[:-2]}_s']:.1f}x)"
                    for k in ("generate_s", "rewards_s", "training_s")}
            lines.append(f"| {rec.get('tag', rec['variant'])}{label} | {m['step_s']:.2f} "
                         f"({m['step_s'] / fl['floor_s']:.2f}x) | {cell['generate_s']} | {cell['rewards_s']} | "
                         f"{cell['training_s']} | {m['other_s']:.2f} | {warm} |")
    return "\n".join(lines)


def grid_table(rows: list[dict[str, Any]]) -> str:
    """The grid as markdown, the best row per variant marked (highest tokens/s)."""
    best = {}
    for r in rows:
        if r.get("tokens_per_s") and r["tokens_per_s"] > best.get(r["variant"], {}).get("tokens_per_s", 0):
            best[r["variant"]] = r
    lines = ["| variant | micro-batch | accum | steps/gen | gen batch | tokens/s | step s | floor s | x floor | "
             "peak GiB: sampling / training (predicted) | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (best)" if best.get(r["variant"]) is r else ""
        tps = f"{r['tokens_per_s']:.0f}{mark}" if r.get("tokens_per_s") else ""
        step = f"{r['step_s']:.3f}" if r.get("step_s") else ""
        xf = f"{r['x_floor']:.2f}" if r.get("x_floor") else ""
        peaks = " / ".join(f"{r[k]:.1f}" if r.get(k) else "-" for k in ("sample_peak_gib", "train_peak_gib"))
        lines.append(f"| {r['variant']} | {r['micro_batch']} | {r['grad_accum']} | {r['steps_per_generation']} | "
                     f"{r['generation_batch']} | {tps} | {step} | {r['floor_s']:.3f} | {xf} | {peaks} "
                     f"({r['predicted_gib']:.1f}) | {r.get('status', '')} |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- reports


def load_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def pool(records: list[dict], key: str) -> list[float]:
    """Pooled timed-step values of one (variant, rank) over its rounds."""
    return [s[key] for r in records for s in r["timed_steps"]]


def run_groups(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["run_id"], []).append(r)
    return groups


def run_title(recs: list[dict]) -> str:
    r = recs[0]
    cap = f", cap {r['mem_cap_gb']} GB" if r.get("mem_cap_gb") else ""
    dist = f", {r['distributed']}" if r.get("distributed") not in (None, "NO", "MULTI_GPU", "MULTI_CPU") else ""
    return (f"{r['policy']} policy, {r['world_size']} x {r['device']}{dist}, grad ckpt {r['grad_ckpt']}, "
            f"{r['per_device_batch']} x {r['completion_len']} tokens/device{cap}")


def per_variant_rank(recs: list[dict]) -> dict[tuple[str, int], list[dict]]:
    out: dict[tuple[str, int], list[dict]] = {}
    for r in recs:
        out.setdefault((r["variant"], r["rank"]), []).append(r)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired_round_ratios(recs: list[dict], variant: str, base: str = "stock") -> list[float]:
    """variant / base step time within each round (variants alternate inside a round)."""
    out = []
    for r in sorted({rec["round"] for rec in recs}):
        vr = per_variant_rank([rec for rec in recs if rec["round"] == r])
        if any(v == variant for v, _ in vr) and any(v == base for v, _ in vr):
            out.append(slowest_rank_median(vr, variant) / slowest_rank_median(vr, base))
    return out


def slowest_rank_median(vr: dict[tuple[str, int], list[dict]], variant: str) -> float:
    """The step time of a variant: the largest per-rank median (DDP steps finish together)."""
    meds = [med(pool(rs, "step_s")) for (v, _), rs in vr.items() if v == variant]
    return max(meds) if meds else float("nan")


def write_reports(out: Path) -> None:
    records = load_jsonl(out / "results.jsonl")
    maxb = load_jsonl(out / "maxbatch.jsonl")
    lines = ["# GRPO benchmark: stock TRL vs grpo-patches", "",
             f"Generated {_dt.datetime.now().isoformat(timespec='seconds')} from `results.jsonl`"
             + (" and `maxbatch.jsonl`" if maxb else "") + ". Step time: CUDA-synchronized at step begin/end, "
             "timed steps after warm-up; spread = p25-p75 [min-max]. Phases: generate = `_generate`, "
             "rewards = `_calculate_rewards`, loss/bwd = `training_step` - `_prepare_inputs`, other = "
             "optimizer step + rest (scoring's log-prob passes are in step - the listed phases). Memory: "
             "peak allocated / reserved per rank.", ""]
    for run_id, recs in run_groups(records).items():
        r0 = recs[0]
        vr = per_variant_rank(recs)
        variants = list(dict.fromkeys(r["variant"] for r in recs))
        ranks = sorted({r["rank"] for r in recs})
        stock = slowest_rank_median(vr, "stock") if "stock" in variants else None
        v = r0["versions"]
        lines += [f"## {run_title(recs)}", "",
                  f"run `{run_id}`, {r0['date']}, {r0['warmup']} warm-up + {r0['steps']} timed steps x "
                  f"{r0['rounds']} round(s), num_generations {r0['num_generations']}, reward model "
                  f"{r0['reward_model_param_bytes'] / GiB:.3f} GiB, torch {v['torch']}, trl {v['trl']}, "
                  f"transformers {v['transformers']}, git {r0.get('git')}" + (f", tag: {r0['tag']}" if r0.get("tag") else ""),
                  "",
                  "| variant | rank | step s (median) | spread | vs stock | floor s | x floor | tokens/s | generate s | "
                  "rewards s | loss/bwd s | other s | peak alloc GiB | peak reserved GiB | peak alloc vs stock |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for variant in variants:
            for rank in ranks:
                rs = vr.get((variant, rank))
                if not rs:
                    continue
                steps = pool(rs, "step_s")
                su = summarize(steps)
                ratio = ""
                if stock and variant != "stock":
                    st = med(pool(vr.get(("stock", rank), []), "step_s"))
                    ratio = f"{med(steps) / st:.3f}" if st == st and st else ""
                peak_a = max((r.get("peak_allocated_bytes") or 0) for r in rs)
                peak_r = max((r.get("peak_reserved_bytes") or 0) for r in rs)
                stock_a = max((r.get("peak_allocated_bytes") or 0) for r in vr.get(("stock", rank), [{}]))
                mem_ratio = f"{peak_a / stock_a:.3f}" if stock_a and variant != "stock" else ""
                floor = (rs[0].get("floor") or {}).get("floor_s")
                floor_cols = f"{floor:.3f} | {med(steps) / floor:.2f}" if floor else " | "
                lines.append(
                    f"| {variant} | {rank} | {su.get('median', float('nan')):.3f} | "
                    f"{su.get('p25', 0):.2f}-{su.get('p75', 0):.2f} [{su.get('min', 0):.2f}-{su.get('max', 0):.2f}] | "
                    f"{ratio} | {floor_cols} | {med(pool(rs, 'tokens_per_s')):.1f} | {med(pool(rs, 'generate_s')):.3f} | "
                    f"{med(pool(rs, 'rewards_s')):.4f} | {med(pool(rs, 'loss_backward_s')):.3f} | "
                    f"{med(pool(rs, 'other_s')):.3f} | {peak_a / GiB:.2f} | {peak_r / GiB:.2f} | {mem_ratio} |")
        lines += ["", "Checks:", ""]
        if stock:
            for variant in variants:
                if variant == "stock":
                    continue
                ratio = slowest_rank_median(vr, variant) / stock
                target = STEP_TARGETS.get(variant)
                verdict = f" -> {'PASS' if ratio <= target else 'FAIL'} (target <= {target})" if target else ""
                lines.append(f"- step time {variant} / stock (slowest rank's median): {ratio:.3f}{verdict}")
                paired = paired_round_ratios(recs, variant)
                if len(paired) > 1:  # drift between rounds cancels in each round's own ratio
                    pm = statistics.median(paired)
                    verdict = f" -> {'PASS' if pm <= target else 'FAIL'} (target <= {target})" if target else ""
                    lines.append(f"- {variant} / stock per round (each round's slowest-rank medians, {len(paired)} "
                                 f"rounds): median {pm:.3f}, range {min(paired):.3f}-{max(paired):.3f}{verdict}")
                first = [r["warmup_steps"][0]["step_s"] for r in recs if r["variant"] == variant and r["warmup_steps"]]
                first_stock = [r["warmup_steps"][0]["step_s"] for r in recs if r["variant"] == "stock" and r["warmup_steps"]]
                if VARIANTS[variant][0] and VARIANTS[variant][0].get("fast_generation") and first and first_stock:
                    extra = max(first) - max(first_stock)
                    saved = stock - slowest_rank_median(vr, variant)
                    pays = f"pays off after {1 + math.ceil(extra / saved)} steps" if saved > 0 else "never pays off"
                    lines.append(f"- {variant} first step {max(first):.1f} s vs stock {max(first_stock):.1f} s "
                                 f"(compilation {extra:+.1f} s); each later step saves {saved:.2f} s: {pays}")
        for variant, base, target in OVERHEAD_PAIRS:
            if variant in variants and base in variants:
                ratio = slowest_rank_median(vr, variant) / slowest_rank_median(vr, base)
                lines.append(f"- step time {variant} / {base} (the patch's own cost, same generation): {ratio:.3f} "
                             f"-> {'PASS' if ratio <= target else 'FAIL'} (target <= {target})")
                paired = paired_round_ratios(recs, variant, base)
                if len(paired) > 1:
                    pm = statistics.median(paired)
                    lines.append(f"- {variant} / {base} per round ({len(paired)} rounds): median {pm:.3f}, range "
                                 f"{min(paired):.3f}-{max(paired):.3f} -> {'PASS' if pm <= target else 'FAIL'} "
                                 f"(target <= {target})")
        if "stock" in variants and "patched-main" in variants:
            non_main = [rk for rk in ranks if rk != 0]
            if not non_main or not any(r.get("peak_allocated_bytes") for r in recs):
                lines.append("- main placement memory: n/a (needs >= 2 GPU ranks)")
            for rk in non_main:
                st, pm = vr.get(("stock", rk)), vr.get(("patched-main", rk))
                if not st or not pm or not st[0].get("peak_allocated_bytes"):
                    continue
                need = r0["reward_model_param_bytes"]
                for kind in ("allocated", "reserved"):
                    saved = (min(r[f"peak_{kind}_bytes"] for r in st)
                             - max(r[f"peak_{kind}_bytes"] for r in pm))
                    verdict = "PASS" if saved >= need else "FAIL"
                    lines.append(f"- main placement, rank {rk}, peak {kind}: stock - patched-main = "
                                 f"{saved / GiB:.3f} GiB vs reward model {need / GiB:.3f} GiB -> {verdict}")
                # What each variant itself allocated: its peak minus what was still allocated when it
                # started (an earlier variant's leftovers in this process would otherwise count against it).
                own = lambda r: r["peak_allocated_bytes"] - r.get("base_allocated_bytes", 0)  # noqa: E731
                saved = min(own(r) for r in st) - max(own(r) for r in pm)
                verdict = "PASS" if saved >= need else "FAIL"
                lines.append(f"- main placement, rank {rk}, peak allocated above each variant's starting "
                             f"allocation: stock - patched-main = {saved / GiB:.3f} GiB vs reward model "
                             f"{need / GiB:.3f} GiB -> {verdict}")
        unfreed = [f"{r['variant']}#{r['round']} rank {r['rank']}" for r in recs if r.get("trainer_freed") is False]
        if unfreed:
            lines.append(f"- WARNING: trainer not garbage-collected after {', '.join(unfreed)}")
        leaks = [r for r in recs if r.get("base_allocated_bytes", 0) > 64 * 2**20]
        if leaks:
            lines.append(f"- WARNING: {len(leaks)} variant(s) started with > 64 MiB still allocated "
                         f"(max {max(r['base_allocated_bytes'] for r in leaks) / GiB:.2f} GiB): memory of an "
                         f"earlier variant was not freed")
        lines.append("")
    if maxb:
        lines += ["## Largest per-device batch under the memory cap", "",
                  "Each probe is a fresh launch that must complete its steps; tokens/s = completion tokens per "
                  "second of the last probe step at the largest batch, all ranks.", "",
                  "| policy | GPUs | grad ckpt | cap GB | completion len | variant | max batch | first failure | "
                  "batch vs stock | tokens/s at max | throughput vs stock | step s at max | floor s | x floor | date |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        def key(m):
            return m["policy"], m["world_size"], m["grad_ckpt"], m["mem_cap_gb"], m["completion_len"]
        stock_of = {key(m): m for m in maxb if m["variant"] == "stock"}
        for m in maxb:
            base = stock_of.get(key(m))
            ratio = tput = ""
            if base and m["variant"] != "stock":
                ratio = f"{m['max_per_device_batch'] / base['max_per_device_batch']:.2f}" if base["max_per_device_batch"] else ""
                if m.get("tokens_per_s_at_max") and base.get("tokens_per_s_at_max"):
                    tput = f"{m['tokens_per_s_at_max'] / base['tokens_per_s_at_max']:.2f}"
            fail = "none up to limit" if m["hit_limit"] else str(m["first_failure"])
            tps = f"{m['tokens_per_s_at_max']:.0f}" if m.get("tokens_per_s_at_max") else ""
            lines.append(f"| {m['policy']} | {m['world_size']} | {m['grad_ckpt']} | {m['mem_cap_gb']} | "
                         f"{m['completion_len']} | {m['variant']} | {m['max_per_device_batch']} | {fail} | "
                         f"{ratio} | {tps} | {tput} | {m.get('step_s_at_max', float('nan')):.2f} | "
                         f"{m.get('floor_s_at_max', float('nan')):.3f} | {m.get('x_floor_at_max', float('nan')):.2f} | "
                         f"{m['date']} |")
        lines.append("")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        write_plots(out, records)
    except ImportError as exc:
        print(f"[bench] no plots ({exc}); install matplotlib", flush=True)


def write_plots(out: Path, records: list[dict]) -> None:
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = run_groups(records)
    colors = {"stock": "#888888", "stock-nofind": "#bbbbbb", "patched-local": "#1f77b4", "patched-main": "#ff7f0e",
              "patched-fast": "#2ca02c", "patched-graph": "#d62728", "stock-graph": "#9467bd"}

    # step time: one group of bars per run, one bar per variant (slowest rank's median, min-max bars)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
    labels = []
    for gi, (_run_id, recs) in enumerate(groups.items()):
        vr = per_variant_rank(recs)
        variants = list(dict.fromkeys(r["variant"] for r in recs))
        width = 0.8 / max(len(variants), 1)
        for vi, variant in enumerate(variants):
            per_rank = [pool(rs, "step_s") for (v, _), rs in vr.items() if v == variant]
            slowest = max(per_rank, key=med)
            x = gi + (vi - (len(variants) - 1) / 2) * width
            m = med(slowest)
            ax.bar(x, m, width * 0.9, color=colors.get(variant), label=variant if gi == 0 else None,
                   yerr=[[m - min(slowest)], [max(slowest) - m]], capsize=3)
            ax.scatter([x] * len(slowest), slowest, s=8, color="black", zorder=3)
        r0 = recs[0]
        labels.append(f"{r0['policy']} {r0['world_size']}x, ckpt {r0['grad_ckpt']}\n"
                      f"{r0['per_device_batch']}x{r0['completion_len']} tok")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("step time, s (median; bars min-max; dots steps)")
    ax.set_title("GRPO step time: stock TRL vs grpo-patches")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)

    # phases: stacked medians per (run, variant), rank 0
    phases = [("generate_s", "generate"), ("score_other_s", "log-probs etc."), ("rewards_s", "rewards"),
              ("loss_backward_s", "loss/backward"), ("other_s", "optimizer/other")]
    bars = []
    for recs in groups.values():
        vr = per_variant_rank(recs)
        r0 = recs[0]
        for variant in dict.fromkeys(r["variant"] for r in recs):
            rs = vr.get((variant, 0))
            if rs:
                bars.append((f"{r0['policy']} {r0['world_size']}x\n{variant}", [med(pool(rs, k)) for k, _ in phases]))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(bars)), 4))
    bottom = [0.0] * len(bars)
    for pi, (_, name) in enumerate(phases):
        vals = [b[1][pi] for b in bars]
        ax.bar(range(len(bars)), vals, 0.7, bottom=bottom, label=name)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b[0] for b in bars], fontsize=7)
    ax.set_ylabel("seconds per step (median, rank 0)")
    ax.set_title("time per phase")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "phases.png", dpi=110)
    plt.close(fig)

    # memory: per run, groups = rank, bars = variant; solid = peak allocated, outline = peak reserved
    mem_groups = [(rid, recs) for rid, recs in groups.items() if any(r.get("peak_allocated_bytes") for r in recs)]
    if not mem_groups:
        return
    fig, axes = plt.subplots(1, len(mem_groups), figsize=(max(5, 3.5 * len(mem_groups)), 4), squeeze=False)
    for ax, (_rid, recs) in zip(axes[0], mem_groups, strict=True):
        vr = per_variant_rank(recs)
        variants = list(dict.fromkeys(r["variant"] for r in recs))
        ranks = sorted({r["rank"] for r in recs})
        width = 0.8 / max(len(variants), 1)
        for vi, variant in enumerate(variants):
            xs = [ri + (vi - (len(variants) - 1) / 2) * width for ri in range(len(ranks))]
            alloc = [max((r.get("peak_allocated_bytes") or 0) for r in vr.get((variant, rk), [{}])) / GiB for rk in ranks]
            res = [max((r.get("peak_reserved_bytes") or 0) for r in vr.get((variant, rk), [{}])) / GiB for rk in ranks]
            ax.bar(xs, res, width * 0.9, fill=False, edgecolor=colors.get(variant), linestyle="--")
            ax.bar(xs, alloc, width * 0.9, color=colors.get(variant), label=variant)
        rm = recs[0]["reward_model_param_bytes"] / GiB
        ax.set_xticks(range(len(ranks)))
        ax.set_xticklabels([f"rank {rk}" for rk in ranks])
        ax.set_ylabel("GiB (solid: peak allocated, dashed: peak reserved)", fontsize=8)
        ax.set_title(run_title(recs).split(", grad")[0] + f"\nreward model {rm:.2f} GiB", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    args = parse_args()
    if args.report_only and args.grid:  # the grid's tables from what its runs recorded
        out = Path(args.out) if args.out else default_out_dir()
        rows = load_jsonl(out / "grid.jsonl")
        print(grid_table(rows) + "\n\n" + grid_phase_table(out))
        sys.exit(0)
    if args.report_only:
        out = Path(args.out) if args.out else default_out_dir()
        n = merge_parts(out, sorted((out / "parts").glob("*.jsonl"))) if (out / "parts").is_dir() else 0
        write_reports(out)
        print(f"[bench] merged {n} record(s) from unmerged parts; wrote {out / 'results.md'}", flush=True)
        sys.exit(0)
    if args.grid and not args.probe:
        if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            sys.exit("--grid is a driver: run it with plain python (it launches one run per row)")
        sys.exit(run_grid(args))
    if args.find_max_batch and not args.probe:
        if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            sys.exit("--find-max-batch is a driver: run it with plain python (it launches the probes)")
        sys.exit(find_max_batch(args))
    code = 1
    try:
        code = worker(args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a launcher ends the other ranks; no hang in a half-done collective
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch 2.13 + gloo can abort or hang at interpreter exit


if __name__ == "__main__":
    main()
