"""Benchmark: TRL's default (eager) generation vs grpo_patches fast generation.

Two modes, random-weight Qwen2.5-like policies (no hub access needed), LoRA r16 on all 7 projections
with a random (nonzero) B, batch 8, 256 new tokens (every row runs to the end: min_new_tokens):

* default (``generate``): ``model.generate`` with TRL 1.16's generation config (built as TRL builds
  it, ``disable_compile=True``, policy in training mode as TRL samples: ``eager``) vs :func:`fast_generate`
  (static cache, compiled decode step, eval mode) on the paths of ``--paths``: transformers' decode
  loop (``fast``), the graph loop from the merged LoRA buffer (``graph``, the default config), the
  graph loop with the adapter's matmuls (``graph_unmerged``: ``merge_lora=False``), with the caches
  and buffer kept between calls (``graph_kept``), and with inductor's combo kernels (``graph_combo``),
  coordinate-descent tuning (``graph_cdt``) or GEMM autotuning with fused prologues / epilogues
  (``graph_autotune``) for the fused step. Reports ms per decode step, its multiple of the
  floor (every weight and the full static cache read once per step at the GPU's HBM bandwidth), the first compiled
  call (compilation), recompilations over later calls with other prompt lengths, and the merged
  buffer's size and allocations. The graph loop does not implement ``min_new_tokens``, so its
  rows run to the end through ``eos_token_id=[]`` instead (the same number of decode steps); a
  failure of a graph path is recorded (``<path>_error``) and the other paths' results are kept.
* ``--trl-step``: stock ``GRPOTrainer`` steps vs the same trainer with fast generation
  (:func:`enable_fast_generation`, what ``apply(fast_generation=True)`` installs) for each loop of
  ``--decode-loop`` (``transformers``, ``graph`` or ``transformers,graph``): the first step
  (compilation) separately, then the mean of ``--steps`` timed steps and their generation share.
* ``--dropout``: sampling with the LoRA dropout on (TRL's training mode) vs off (the kit's default),
  eager and graph loop, and what the dropout does to the sampled distribution (:func:`bench_dropout`).

Prints a markdown table and writes JSON to ``--out``.

    python benchmarks/bench_generation.py --policy 0.5b,1.5b --out benchmarks/results/generation.json
    python benchmarks/bench_generation.py --policy 1.5b --paths eager,graph_unmerged,graph --repeats 1   # the merged buffer's gain
    python benchmarks/bench_generation.py --trl-step --policy 1.5b --out benchmarks/results/generation_trl.json
    python benchmarks/bench_generation.py --trl-step --decode-loop transformers,graph --policy 1.5b
    python benchmarks/bench_generation.py --dropout --policy 1.5b --repeats 2 --out benchmarks/results/dropout.json
    python benchmarks/bench_generation.py --policy tiny --force-compile --backend aot_eager   # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_grpo import POLICIES as GRPO_POLICIES  # noqa: E402
from bench_grpo import hbm_bytes_per_s, kernel_table  # noqa: E402

from grpo_patches import generation  # noqa: E402
from grpo_patches.generation import FastGenerationConfig, fast_generate  # noqa: E402
from grpo_patches.targets.trl_generation import enable_fast_generation  # noqa: E402

# bench_grpo's Qwen2.5-like shapes; the CPU smoke model ties its embeddings, as the real ones do
POLICIES = {**GRPO_POLICIES, "tiny": {**GRPO_POLICIES["tiny"], "tie_word_embeddings": True}}
PAD, EOS, BOS = 0, 1, 2


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device) -> None:
    """Free what a finished benchmark left (its model, caches, compiled graphs) before the next."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def build_policy(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_patches.defaults import lora_config

    torch.manual_seed(seed)
    config = Qwen2Config(max_position_embeddings=4096, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
                         **POLICIES[name])
    with torch.device(device):  # random init directly on the GPU (seconds, not minutes, for 1.5B)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    return model, lora_config()  # the kit's pinned LoRA: r16, alpha 32, dropout 0.05, all seven projections


def randomize_lora_b(model, seed: int = 1, std: float = 0.02):
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)


def merged_bytes(model) -> int:
    """What the merged-LoRA buffer takes (the adapted layers' base weights, once more)."""
    return sum(m.get_base_layer().weight.numel() * m.get_base_layer().weight.element_size()
               for m, _ in generation.mergeable_layers(model.eval()))


def floor_ms(model, batch: int, cache_len: int) -> tuple[float, float]:
    """HBM floor of one decode step: every weight read once (the LoRA factors are counted too), and
    the full static cache's K and V (the attention reads the whole padded cache), at the model's GPU's
    bandwidth (``bench_grpo.hbm_bytes_per_s``)."""
    device = next(model.parameters()).device
    bandwidth = hbm_bytes_per_s(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * cache_len * batch * 2  # bf16 K and V
    return params / bandwidth * 1e3, kv / bandwidth * 1e3


#: the sampler's temperature and top-p (``--temperature`` / ``--top-p``; GRPOConfig's defaults: 1.0, 1.0)
SAMPLING = {"temperature": 1.0, "top_p": 1.0}


def trl_generation_config(new_tokens: int, *, graph: bool = False):
    """TRL 1.16's GenerationConfig for the transformers path (GRPOConfig defaults unless ``--temperature`` /
    ``--top-p`` set them), full-length rows.

    ``graph``: full-length rows without ``min_new_tokens`` (which the graph loop does not implement):
    no EOS token at all instead."""
    from transformers import GenerationConfig

    kwargs = {"max_new_tokens": new_tokens, "do_sample": True, "pad_token_id": PAD, "bos_token_id": BOS,
              "eos_token_id": [EOS], **SAMPLING, "top_k": 0, "min_p": None,
              "repetition_penalty": 1.0, "cache_implementation": None, "min_new_tokens": new_tokens}
    if graph:
        kwargs.update(eos_token_id=[], min_new_tokens=None)
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


def time_eager(model, label: str, training: bool, base_config, one_token, lengths, batch, vocab, new,
               device) -> dict:
    """``model.generate`` as TRL calls it, in training mode (dropout on, as TRL samples) or eval mode;
    ms per decode step over the calls after the first (which warms up kernels and the allocator)."""
    model.train(training)
    timings = []
    for i, length in enumerate(lengths):
        ids, mask = prompts(batch, length, vocab, device, seed=i)
        with torch.no_grad():
            t_pre, _ = timed(lambda i=ids, m=mask: model.generate(input_ids=i, attention_mask=m,
                                                                  generation_config=one_token), device)
            t, out = timed(lambda i=ids, m=mask: model.generate(input_ids=i, attention_mask=m,
                                                                generation_config=base_config), device)
        assert out.shape[1] == length + new, out.shape
        if i > 0 or len(lengths) == 1:
            timings.append((t, t_pre))
    model.train()
    return {f"{label}_s_per_call": statistics.mean(t for t, _ in timings),
            f"{label}_ms_per_decode_step": statistics.mean((t - p) / max(new - 1, 1) * 1e3 for t, p in timings)}


def time_fast(model, label: str, config, base_config, one_token, lengths, batch, vocab, new, device) -> dict:
    """First call (compilation), then ms per decode step over the later calls (other prompt lengths)."""
    timings, first, res = [], None, {}
    graphs_before = graphs_warm = graphs()
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
            timings.append((t, t_pre))
    res[f"{label}_first_call_s"] = first
    res[f"{label}_graphs_compiled_first_call"] = graphs_warm - graphs_before
    res[f"{label}_recompiles_after_warmup"] = graphs() - graphs_warm
    if timings:
        res[f"{label}_s_per_call"] = statistics.mean(t for t, _ in timings)
        res[f"{label}_ms_per_decode_step"] = statistics.mean((t - p) / max(new - 1, 1) * 1e3 for t, p in timings)
    return res


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

    paths = args.path_list
    # stock TRL: eager, dynamic cache, policy in training mode (LoRA dropout on) as TRL samples
    if "eager" in paths:
        res.update(time_eager(model, "eager", True, base_config, one_token, lengths, batch, vocab, new, device))

    # fast paths: transformers' decode loop (compiled forward), then the graph loop (from the merged
    # LoRA buffer, the default, and with the adapter's matmuls, merge_lora=False), in the same run
    fast_config = FastGenerationConfig(force_compile=args.force_compile, backend=args.backend, mode=args.mode,
                                       bucket=args.bucket)
    if "fast" in paths:
        res.update(time_fast(model, "fast", fast_config, base_config, one_token, lengths, batch, vocab, new, device))
        gc.collect()
    graph_config = dataclasses.replace(fast_config, decode_loop="graph", check_every=args.check_every,
                                       graph_steps=args.graph_steps)
    graph_paths = {"graph": graph_config,
                   "graph_model": dataclasses.replace(graph_config, fused_decode=False),
                   "graph_unmerged": dataclasses.replace(graph_config, merge_lora=False),
                   "graph_kept": dataclasses.replace(graph_config, release_after_sampling=False),
                   # inductor options for the fused step (fewer launches?): horizontal fusion of independent
                   # small kernels (the K and V cache writes, q's and k's RoPE), and Triton configs tuned per kernel
                   "graph_combo": dataclasses.replace(graph_config, options={"combo_kernels": True}),
                   "graph_cdt": dataclasses.replace(graph_config, options={"coordinate_descent_tuning": True}),
                   # Triton GEMM templates where they win, with pointwise prologues / epilogues fused into them
                   "graph_autotune": dataclasses.replace(graph_config, options={
                       "max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON",
                       "epilogue_fusion": True, "prologue_fusion": True})}
    for label, config in graph_paths.items():
        if label not in paths:
            continue
        print(f"[{name}] {time.strftime('%T')} {label}: timing", file=sys.stderr, flush=True)
        try:
            stats0 = copy.deepcopy(generation.GRAPH_STATS)
            res.update(time_fast(model, label, config, trl_generation_config(new, graph=True),
                                 trl_generation_config(1, graph=True), lengths, batch, vocab, new, device))
            stats = generation.GRAPH_STATS
            res[f"{label}_calls"] = stats.calls - stats0.calls
            res[f"{label}_fallbacks"] = stats.fallbacks - stats0.fallbacks
            fused = stats.fused
            res[f"{label}_fused"] = {"calls": fused.calls - stats0.fused.calls, "captures": fused.captures
                                     - stats0.fused.captures, "replays": fused.replays - stats0.fused.replays,
                                     "capture_s": fused.capture_seconds - stats0.fused.capture_seconds,
                                     "not_fused_because": fused.last_reason, "capture_errors": fused.capture_errors}
            if res[f"{label}_fallbacks"]:
                res[f"{label}_error"] = f"fell back to transformers' loop: {stats.last_reason}"
            buffer = generation._MERGED.get(model)
            if buffer is not None:
                res[f"{label}_merged_buffer"] = {"allocations": buffer.allocations, "moves": buffer.moves,
                                                 "refreshes": buffer.refreshes}
        except Exception as exc:  # noqa: BLE001 - report, keep the other paths' numbers
            res[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
            res[f"{label}_traceback"] = traceback.format_exc(limit=8)
            print(f"[{name}] {label} decode loop failed: {res[f'{label}_error']}", file=sys.stderr, flush=True)
        gc.collect()
        if args.out:  # what is measured so far survives a timeout of the whole run
            Path(args.out + ".partial").write_text(json.dumps(res, indent=2, default=str))
    res["merged_buffer_bytes"] = merged_bytes(model)
    res["merged_buffer_gib"] = res["merged_buffer_bytes"] / 2**30
    res["graphs_compiled_first_call"] = res.get("fast_graphs_compiled_first_call")
    res["recompiles_after_warmup"] = res.get("fast_recompiles_after_warmup")
    for label in ("fast", *GRAPH_PATHS):
        if f"{label}_ms_per_decode_step" in res and "eager_ms_per_decode_step" in res:
            res[f"speedup_{label}"] = res["eager_ms_per_decode_step"] / res[f"{label}_ms_per_decode_step"]
    cache_len = -(-max(lengths) // args.bucket) * args.bucket + new
    res["hbm_floor_ms_params"], res["hbm_kv_ms_full_cache"] = floor_ms(model, batch, cache_len)
    floor = res["hbm_floor_ms_params"] + res["hbm_kv_ms_full_cache"]
    res["floor_ms_per_step"] = floor
    for label in ("eager", "fast", *GRAPH_PATHS):
        if f"{label}_ms_per_decode_step" in res:
            res[f"{label}_x_floor"] = res[f"{label}_ms_per_decode_step"] / floor
    if args.profile:  # the timed calls' cache and output shapes: no recompilation
        res["profile"] = {}
        for label in (p for p in paths if p in graph_paths and f"{p}_error" not in res):
            print(f"[{name}] {time.strftime('%T')} {label}: profile", file=sys.stderr, flush=True)
            res["profile"][label] = profile_decode(model, graph_paths[label], batch, L, vocab, new, device)
            if args.out:
                Path(args.out + ".partial").write_text(json.dumps(res, indent=2, default=str))
    model = None
    release(device)
    return res


GRAPH_PATHS = ("graph", "graph_model", "graph_unmerged", "graph_kept", "graph_combo", "graph_cdt", "graph_autotune")


def profile_decode(model, config, batch: int, length: int, vocab: int, new: int, device) -> dict:
    """Device time per decode step by kernel, from torch.profiler over one ``new``-token call with
    the CUDA graph off (the compiled step launched token by token, so every kernel is its own record;
    the kernels are the graph's). Kernel time per step against the graph's measured step time gives
    what launches and gaps cost."""
    from torch.profiler import ProfilerActivity, profile

    from grpo_patches.generation import fused_loop

    cfg, steps = trl_generation_config(new, graph=True), new - 1
    ids, mask = prompts(batch, length, vocab, device, seed=0)
    graphs_on = fused_loop._graphs_on
    fused_loop._graphs_on = lambda d: False
    try:
        fast_generate(model, ids, mask, generation_config=cfg, config=config)  # compile, warm
        sync(device)
        on_cuda = device.type == "cuda"  # on CPU (smoke runs) the records are operators, not kernels
        with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
            fast_generate(model, ids, mask, generation_config=cfg, config=config)
            sync(device)
    finally:
        fused_loop._graphs_on = graphs_on
    if on_cuda:  # the prefill's kernels are in the record too: per-step figures overstate the step a little
        return kernel_table(prof.events(), steps)
    ops = prof.key_averages()  # CPU smoke runs: operators, not kernels
    return {"steps": steps, "top": [{"op": o.key, "per_step": o.count / steps,
                                     "ms_per_step": o.self_cpu_time_total / steps / 1e3} for o in ops][:25]}


# --dropout -----------------------------------------------------------------------------------------


def completion_logprobs(model, seqs, mask, prompt_len: int, *, training: bool, adapter: bool = True):
    """fp32 log-softmax over the completion positions, in training (dropout) or eval mode."""
    model.train(training)
    full = torch.cat([mask, torch.ones_like(seqs[:, prompt_len:])], dim=1)
    with torch.no_grad(), (contextlib.nullcontext() if adapter else model.disable_adapter()):
        logits = model(input_ids=seqs, attention_mask=full).logits[:, prompt_len - 1:-1]
    model.train()
    return logits.float().log_softmax(-1)


def bench_dropout(name: str, args, device, dtype) -> dict:
    """Sampling with the LoRA dropout on (TRL's training mode) vs off (the kit's eval mode), same weights.

    Speed: eager ``generate`` and the kit's graph loop, each in both modes. Samples: on sequences the
    kit sampled, the per-token KL between a dropout-on distribution and the eval-mode policy, next to
    the KL the whole adapter makes (eval with vs without it): the share of the adapter's effect that
    dropout adds as noise. And the noise two dropout masks put into a log-prob ratio (what TRL's
    ``old_per_token_logps``, recomputed in training mode, compare against): its std and the share of
    tokens whose ratio leaves ``[1 - 0.2, 1 + 0.2]`` (GRPOConfig's epsilon) before any update.
    """
    from peft import get_peft_model

    model, lora = build_policy(name, dtype, device)
    model = get_peft_model(model, lora)
    randomize_lora_b(model, std=args.lora_b_std)
    vocab, new, batch = model.config.vocab_size, args.new_tokens, args.batch
    full, one = trl_generation_config(new, graph=True), trl_generation_config(1, graph=True)  # no EOS: full rows
    L = args.prompt_length
    lengths = [L - d for d in (0, L // 8, L // 4, L // 16)][: args.repeats + 1]
    res: dict = {"policy": name, "mode": "dropout", "batch": batch, "new_tokens": new, "prompt_lengths": lengths,
                 "lora_dropout": lora.lora_dropout, "lora_b_std": args.lora_b_std}
    for on in (True, False):
        res.update(time_eager(model, f"eager_dropout_{'on' if on else 'off'}", on, full, one, lengths, batch, vocab,
                              new, device))
    # graph loop: both modes compiled first (dynamo keeps one graph per mode), then timed calls that
    # alternate the order of the modes, so neither gets the quieter half of the run
    configs = {on: FastGenerationConfig(force_compile=args.force_compile, backend=args.backend, mode=args.mode,
                                        bucket=args.bucket, decode_loop="graph", dropout_off_while_sampling=not on)
               for on in (False, True)}
    timings: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i, length in enumerate(lengths):
            ids, mask = prompts(batch, length, vocab, device, seed=i)
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                model.train()  # dropout_off_while_sampling=False samples in the model's mode: training
                label = f"graph_dropout_{'on' if on else 'off'}"
                before = graphs()
                t_pre, _ = timed(functools.partial(fast_generate, model, ids, mask, generation_config=one,
                                                   config=configs[on]), device)
                t, out = timed(functools.partial(fast_generate, model, ids, mask, generation_config=full,
                                                 config=configs[on]), device)
                assert out.shape[1] == length + new, out.shape
                if i == 0:
                    res[f"{label}_first_call_s"] = t_pre + t
                else:
                    timings[on].append((t - t_pre) / max(new - 1, 1) * 1e3)
                    res[f"{label}_recompiles_after_warmup"] = res.get(f"{label}_recompiles_after_warmup", 0) + (
                        graphs() - before)
        for on, ms in timings.items():
            if ms:
                res[f"graph_dropout_{'on' if on else 'off'}_ms_per_decode_step"] = statistics.mean(ms)
                res[f"graph_dropout_{'on' if on else 'off'}_ms_per_call"] = ms
    except Exception as exc:  # noqa: BLE001 - report, keep the eager numbers
        res["graph_error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] graph loop failed: {res['graph_error']}", file=sys.stderr, flush=True)
    for path in ("eager", "graph"):
        off, on = res.get(f"{path}_dropout_off_ms_per_decode_step"), res.get(f"{path}_dropout_on_ms_per_decode_step")
        if off and on:
            res[f"{path}_dropout_on_vs_off"] = on / off

    ids, mask = prompts(batch, L, vocab, device, seed=99)
    seqs = fast_generate(model, ids, mask, generation_config=full,
                         config=FastGenerationConfig(force_compile=args.force_compile, backend=args.backend,
                                                     mode=args.mode, bucket=args.bucket, decode_loop="graph"))
    tokens = seqs[:, L:].unsqueeze(-1)
    evl = completion_logprobs(model, seqs, mask, L, training=False)
    base = completion_logprobs(model, seqs, mask, L, training=False, adapter=False)
    kl_adapter = (evl.exp() * (evl - base)).sum(-1).mean().item()
    del base
    m1 = completion_logprobs(model, seqs, mask, L, training=True)
    kl_dropout = (m1.exp() * (m1 - evl)).sum(-1).mean().item()
    lp1, lp_eval = m1.gather(-1, tokens).squeeze(-1), evl.gather(-1, tokens).squeeze(-1)
    del m1, evl
    lp2 = completion_logprobs(model, seqs, mask, L, training=True).gather(-1, tokens).squeeze(-1)
    ratio = (lp1 - lp2).exp()
    res.update(kl_dropout_vs_eval=kl_dropout, kl_adapter_vs_base=kl_adapter,
               dropout_kl_share_of_adapter=kl_dropout / kl_adapter if kl_adapter > 0 else math.nan,
               logp_dropout_minus_eval_abs_mean=(lp1 - lp_eval).abs().mean().item(),
               logp_two_masks_std=(lp1 - lp2).std().item(),
               ratio_two_masks_outside_clip=((ratio < 0.8) | (ratio > 1.2)).double().mean().item())
    model = seqs = None
    release(device)
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


def run_trl(name: str, args, device, dtype, fast: bool, decode_loop: str = "transformers") -> dict:
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
        output_dir=os.path.join(args.workdir, f"{name}-{decode_loop if fast else 'stock'}"), report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, per_device_train_batch_size=args.batch,
        num_generations=args.batch, max_completion_length=args.new_tokens, max_steps=1 + args.steps,
        learning_rate=1e-6, seed=0, use_cpu=on_cpu, bf16=dtype == torch.bfloat16 and not on_cpu,
        # full-length rows; the graph loop has no min_new_tokens: no EOS token instead (same decode steps)
        generation_kwargs=({"eos_token_id": []} if fast and decode_loop == "graph"
                           else {"min_new_tokens": args.new_tokens}), dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer(vocab),
                          peft_config=lora)
    randomize_lora_b(trainer.model)
    state = enable_fast_generation(trainer, FastGenerationConfig(
        force_compile=args.force_compile, backend=args.backend, mode=args.mode, bucket=args.bucket,
        decode_loop=decode_loop, check_every=args.check_every, graph_steps=args.graph_steps)) if fast else None
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
    res = {"policy": name, "mode": f"fast-{decode_loop}" if fast else "stock", "first_step_s": step_seconds[0],
           "first_generation_s": gen_seconds[0], "step_s": statistics.mean(timed_steps),
           "generation_s": statistics.mean(timed_gen), "steps_timed": len(timed_steps)}
    res["generation_share"] = res["generation_s"] / res["step_s"]
    if state is not None:
        res["fast_state"] = state.summary()
    trainer = model = None
    release(device)
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
    ap.add_argument("--dropout", action="store_true",
                    help="sampling with the LoRA dropout on vs off: speed (eager, graph loop) and the samples")
    ap.add_argument("--lora-b-std", type=float, default=0.02, help="--dropout: std of the random LoRA B")
    ap.add_argument("--paths", default="eager,fast,graph,graph_unmerged",
                    help="generate mode: comma list of eager, fast, " + ", ".join(GRAPH_PATHS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (16 for tiny)")
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls after the first (generate mode)")
    ap.add_argument("--steps", type=int, default=5, help="timed trainer steps after the first (--trl-step)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the sampler's (the kit's pinned: 0.7)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the sampler's (the kit's pinned: 0.9)")
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--force-compile", action="store_true", help="compile on CPU too")
    ap.add_argument("--decode-loop", default="transformers",
                    help="--trl-step: the fast trainer's decode loop(s), comma list of: transformers, graph")
    ap.add_argument("--check-every", type=int, default=16, help="graph loop: decode steps between host checks")
    ap.add_argument("--graph-steps", type=int, default=None,
                    help="fused loop: decode steps per captured CUDA graph (default: --check-every)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workdir", default="/tmp/bench_generation")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--profile", action="store_true",
                    help="generate mode: also a kernel profile of each graph path's decode step (CUDA)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    if unknown := [n for n in names if n not in POLICIES]:
        ap.error(f"unknown policy {unknown}; choose from {list(POLICIES)}")
    loops = [n.strip() for n in args.decode_loop.split(",") if n.strip()]
    if bad := [n for n in loops if n not in generation.DECODE_LOOPS]:
        ap.error(f"unknown decode loop {bad}; choose from {list(generation.DECODE_LOOPS)}")
    args.path_list = [n.strip() for n in args.paths.split(",") if n.strip()]
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p)
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
            for fast, loop in [(False, "transformers")] + [(True, loop) for loop in loops]:
                try:
                    rows.append(run_trl(name, args, device, dtype, fast, loop))
                except Exception as exc:  # noqa: BLE001 - report, keep the other runs' numbers
                    rows.append({"policy": name, "mode": f"fast-{loop}" if fast else "stock",
                                 "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)})
                    gc.collect()
                    torch._dynamo.reset()
                print(json.dumps(rows[-1], default=str), flush=True)
        print(table(rows, [("policy", "policy"), ("path", "mode"), ("first step s", "first_step_s"),
                           ("first generation s", "first_generation_s"), ("step s", "step_s"),
                           ("generation s", "generation_s"), ("generation share", "generation_share"),
                           ("timed steps", "steps_timed"), ("error", "error")]))
    elif args.dropout:
        for name in names:
            rows.append(bench_dropout(name, args, device, dtype))
            print(json.dumps(rows[-1], default=str), flush=True)
        print(table(rows, [("policy", "policy"), ("eager ms/step dropout off", "eager_dropout_off_ms_per_decode_step"),
                           ("eager on", "eager_dropout_on_ms_per_decode_step"), ("on/off", "eager_dropout_on_vs_off"),
                           ("graph ms/step off", "graph_dropout_off_ms_per_decode_step"),
                           ("graph on", "graph_dropout_on_ms_per_decode_step"), ("on/off", "graph_dropout_on_vs_off"),
                           ("graph error", "graph_error"),
                           ("KL dropout vs eval", "kl_dropout_vs_eval"), ("KL adapter vs base", "kl_adapter_vs_base"),
                           ("dropout share of adapter KL", "dropout_kl_share_of_adapter"),
                           ("logp std, two masks", "logp_two_masks_std"),
                           ("ratio outside clip, two masks", "ratio_two_masks_outside_clip")]))
    else:
        for name in names:
            rows.append(bench_generate(name, args, device, dtype))
            print(json.dumps(rows[-1], default=str), flush=True)
        print(table(rows, [("policy", "policy"), ("batch", "batch"), ("floor ms/step", "floor_ms_per_step"),
                           ("eager ms/step", "eager_ms_per_decode_step"), ("x floor", "eager_x_floor"),
                           ("fast ms/step", "fast_ms_per_decode_step"), ("x floor", "fast_x_floor"),
                           ("graph unmerged ms/step", "graph_unmerged_ms_per_decode_step"),
                           ("x floor", "graph_unmerged_x_floor"),
                           ("graph, model forward (merged) ms/step", "graph_model_ms_per_decode_step"),
                           ("x floor", "graph_model_x_floor"),
                           ("graph, fused step (merged) ms/step", "graph_ms_per_decode_step"), ("x floor", "graph_x_floor"),
                           ("graph kept ms/step", "graph_kept_ms_per_decode_step"),
                           ("graph combo kernels ms/step", "graph_combo_ms_per_decode_step"),
                           ("graph coordinate descent ms/step", "graph_cdt_ms_per_decode_step"),
                           ("graph autotune + prologue fusion ms/step", "graph_autotune_ms_per_decode_step"),
                           ("graph speed-up vs eager", "speedup_graph"),
                           ("first graph call s (compile)", "graph_first_call_s"),
                           ("graph recompiles after warm-up", "graph_recompiles_after_warmup"),
                           ("graph error", "graph_error"), ("unmerged error", "graph_unmerged_error"),
                           ("HBM floor ms/step (params)", "hbm_floor_ms_params"),
                           ("KV read ms/step (full cache)", "hbm_kv_ms_full_cache"),
                           ("merged buffer GiB", "merged_buffer_gib"),
                           ("first fast call s (compile)", "fast_first_call_s"),
                           ("recompiles after warm-up", "recompiles_after_warmup"),
                           ("eager s/call", "eager_s_per_call"), ("fast s/call", "fast_s_per_call")]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
