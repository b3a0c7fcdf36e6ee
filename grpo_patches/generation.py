"""Fast generation for TRL's GRPOTrainer: compiled decoding under a static KV cache, dropout off.

Stock TRL (1.16) builds its ``GenerationConfig`` with ``disable_compile=True`` and samples with the
policy in training mode, so every decode step runs eagerly (67-82 ms per step for a 1.5B LoRA policy
on an H200, ~100x the HBM floor; FACTS.md). This module re-enables transformers' own compiled
decoding around TRL's ``_generate_single_turn`` and nothing else:

* **Compiled decoding.** A copy of the trainer's generation config gets
  ``cache_implementation="static"``, ``disable_compile=False`` and a ``CompileConfig``
  (inductor, ``mode="reduce-overhead"`` = CUDA graphs, ``dynamic=False``, ``fullgraph=False``).
  transformers compiles only the one-token decode step (``model.__call__``); the prefill stays
  eager. Weights are read from the modules at every call (dynamo inlines ``nn.Module`` s and lifts
  parameters as graph inputs; CUDA graphs see in-place optimizer updates at the same addresses),
  so an optimizer step never leaves stale weights in the compiled path (tested).
* **Graph decode loop (``decode_loop="graph"``, the default).** With transformers' loop the compiled
  forward is only part of a token: logits processors, sampling, input preparation, kwargs updates
  and the stopping check run eagerly in Python every token, and the stopping check syncs host and
  GPU every token, so host work serializes with the graph replay (10.9 ms per step for the 1.5B
  policy, 6.9 ms for 0.5B; results.md). The graph loop replaces TRL's ``model.generate`` call for
  that call only: an eager prefill into the same pooled static cache, then one compiled function
  per token that runs the forward, the temperature / top-k / top-p warping (transformers' warper
  semantics, ties and ``min_tokens_to_keep=1`` included), the sample (Gumbel-max: exactly
  softmax) or greedy pick, and the EOS/pad bookkeeping, on fixed shapes (a full-cache-length
  attention mask, the cache position as a tensor), so it is one graph replay and the host queues
  the next step without waiting; "every row ended" is checked on the host only every
  ``check_every`` steps and the output is trimmed to exactly what ``generate`` returns. Weights
  are graph inputs as above, the pool and the bucketing keep one compilation per bucket. A config
  it does not implement (penalties, ``min_p``, ``min_new_tokens``, beams, extra processors or
  stopping criteria, score outputs, ``record_sampling_logprobs``...) goes to transformers' loop,
  with one warning saying why: a silently different sampler would be worse than a slower one.
  Measured on an H200 (1.5B policy, 8 x 256 tokens): 5.62 ms per decode step vs 10.2 ms for
  transformers' compiled loop and 57.8 ms eager; GRPO step 0.157x stock vs 0.177x
  (benchmarks/results/2026-11-29-h200-x4/). ``decode_loop="transformers"`` keeps transformers' loop.
* **Cache-length bucketing (no recompilation when prompt lengths change).** The decode graph's
  shapes are (batch, static cache length); the prompt length enters only through the cache length
  (transformers sizes it ``prompt + max_new_tokens - 1``, so every new prompt length recompiled:
  77 s on an H200). Here the cache length is ``round_up(prompt, bucket) + max_new_tokens`` and
  never shrinks (a per-trainer high-water mark), so decoding recompiles only when a prompt first
  crosses a bucket boundary above every earlier one, and never if ``max_prompt_length`` pre-sizes
  the cache. Prompts are not padded by default: the prefill is eager, so its shape costs no
  compilation, and padding would only add prefill work. ``pad_prompts=True`` additionally
  left-pads the prompt tensors to a multiple of ``bucket`` (through TRL's own
  ``pad_to_multiple_of``, zero attention mask on the pads; greedy tokens are identical, tested).
* **One static cache, reset in place.** transformers allocates a new ``StaticCache`` per call;
  its tensors are static-address inputs of the CUDA graph, so each call would re-record the graph
  and keep one more recording in the tree. The trainer keeps one cache per (batch, cache length)
  (:class:`StaticCachePool`), ``reset()`` before each call, passed as ``past_key_values``.
* **Upstream hook leak.** TRL disables/re-enables gradient checkpointing around every generation,
  and each enable on a PEFT model adds one more input-embedding forward hook (never removed); the
  hook count is a dynamo guard, so decoding would recompile at every step and fall back to eager
  after 8. Those hooks (no-ops under ``no_grad``) are hidden while sampling
  (:func:`hidden_require_grad_hooks`).
* **Dropout semantic.** Sampling runs with the policy in ``eval()`` mode (every module's training
  flag is restored exactly afterwards): no LoRA dropout, no attention/hidden dropout (HF attention
  dropout is functional and keyed on the attention module's flag, so "dropout modules only" would
  miss it), no other train-only behaviour. The sampling policy is therefore the deterministic
  network, as in TRL's vLLM mode. The loss is untouched: the policy is back in training mode, so the
  pinned LoRA dropout (0.05) still regularizes the loss's forward pass; TRL's ``old_per_token_logps``
  (when computed) keep TRL's own semantic (training mode). Stock TRL samples with dropout on.
* **No LoRA merge.** Merging the adapter into the base weights and unmerging afterwards does not
  give the base weights back bit-identically in floating point (``W + BA*s - BA*s != W``; the test
  shows the round trip changing weights), so the adapter stays unmerged; the compiled graph runs
  the LoRA matmuls (small: r=16). Generation never writes any parameter (tested bit-identical).
* **Where it does not run.** Without CUDA (or XPU), without ``torch.compile``/dynamo, or under
  DeepSpeed / FSDP (parameters are gathered per call), it warns once and generates eagerly with
  dropout off (and prompt padding if asked): both are correct on any device.
  ``force_compile=True`` compiles on CPU too (the tests do, with ``backend="aot_eager"``; inductor on
  CPU takes ~70 s to compile even a 2-layer model). vLLM and continuous-batching paths are left
  alone.

Use it through ``grpo_patches.apply(fast_generation=True)``, or on one built trainer with
:func:`enable_fast_generation`. No TRL import at module top.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "FAST_GEN_ATTR",
    "FastGenerationConfig",
    "FastGenerationState",
    "GraphDecodeStats",
    "SampledLogprobs",
    "StaticCachePool",
    "build_generation_config",
    "compile_decision",
    "enable_fast_generation",
    "fast_generate",
    "graph_decode_support",
    "hidden_require_grad_hooks",
    "sampling_mode",
    "wrap_generate",
]

FAST_GEN_ATTR = "_grpo_patches_fast_generation"
_COMPILE_DEVICES = ("cuda", "xpu")
DECODE_LOOPS = ("transformers", "graph")
_warned: set[str] = set()
_warn_lock = threading.Lock()
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fast_generate's caches, per model


@dataclass(frozen=True)
class FastGenerationConfig:
    """Options of ``apply(fast_generation=...)``; ``True`` means ``FastGenerationConfig()``.

    Attributes:
        bucket: the static cache length is ``round_up(prompt_length, bucket) + max_new_tokens``;
            decoding recompiles at most once per bucket a prompt first reaches.
        max_prompt_length: size the cache for prompts up to this length from the first call on (no
            recompilation at all below it); longer prompts still work (one recompilation).
        pad_prompts: also left-pad the prompt tensors to a multiple of ``bucket``.
        dropout_off_while_sampling: sample with the policy in eval mode (restored afterwards).
        compile: compile decoding where it is supported (CUDA/XPU); ``False``: always eager.
        force_compile: compile on any device, CPU included (tests, debugging).
        backend, mode, fullgraph, dynamic, options: the ``transformers.CompileConfig`` (``mode`` is
            ignored for a backend other than inductor).
        reuse_cache: keep one static cache per (batch, cache length) and reset it in place for every
            call, so the compiled step (and its CUDA graph) sees the same cache addresses each step;
            ``False``: transformers allocates a new static cache per call.
        record_sampling_logprobs: keep the log-probabilities (after temperature, before top-k/top-p
            truncation: TRL's recomputation's semantic) of the sampled tokens on the trainer's state
            (``last_sampling_logprobs``). Diagnostic only: TRL's regular path is still given ``None``.
            Runs on the ``"transformers"`` decode loop only (``"graph"`` falls back to it).
        decode_loop: ``"transformers"``: transformers' ``generate`` runs the loop (compiled forward,
            eager sampling); ``"graph"``: one compiled step per token that also samples and keeps the
            EOS bookkeeping, the host checking for the end only every ``check_every`` steps
            (compiled decoding and a plain temperature/top-k/top-p or greedy config only; anything
            else falls back to ``"transformers"``, with one warning).
        check_every: ``decode_loop="graph"``: decode steps between host checks of "every row ended".
    """

    bucket: int = 64
    max_prompt_length: int | None = None
    pad_prompts: bool = False
    dropout_off_while_sampling: bool = True
    compile: bool = True
    force_compile: bool = False
    backend: str | Callable = "inductor"
    mode: str | None = "reduce-overhead"
    fullgraph: bool = False
    dynamic: bool | None = False
    options: dict | None = None
    reuse_cache: bool = True
    record_sampling_logprobs: bool = False
    decode_loop: str = "graph"
    check_every: int = 16

    def __post_init__(self) -> None:
        if self.decode_loop not in DECODE_LOOPS:
            raise ValueError(f"FastGenerationConfig: decode_loop={self.decode_loop!r} must be one of {DECODE_LOOPS}.")
        for name in ("bucket", "check_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FastGenerationConfig: {name}={value!r} must be a positive integer.")
        mpl = self.max_prompt_length
        if mpl is not None and (isinstance(mpl, bool) or not isinstance(mpl, int) or mpl < 1):
            raise ValueError(f"FastGenerationConfig: max_prompt_length={mpl!r} must be None or a positive integer.")

    @classmethod
    def coerce(cls, value: Any) -> FastGenerationConfig | None:
        """``False``/``None`` -> None, ``True`` -> defaults, a dict -> fields, a config -> itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(
            f"fast_generation={value!r}: expected a bool, a dict of FastGenerationConfig fields or a "
            f"FastGenerationConfig."
        )


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def compile_decision(device: torch.device | str, config: FastGenerationConfig, *,
                     sharded: str | None = None) -> tuple[bool, str]:
    """Whether decoding is compiled on ``device``, and why not when it is not."""
    device = torch.device(device)
    if not config.compile:
        return False, "compile=False"
    if sharded is not None:
        return False, f"{sharded} gathers parameters for every generation call"
    if not hasattr(torch, "compile"):
        return False, "this torch has no torch.compile"
    try:
        import torch._dynamo as dynamo

        if not dynamo.is_dynamo_supported():
            return False, "torch.compile (dynamo) is not supported on this Python/platform"
    except Exception as exc:  # pragma: no cover - exotic installs
        return False, f"torch._dynamo is unavailable ({exc})"
    if device.type not in _COMPILE_DEVICES and not config.force_compile:
        return False, f"the policy is on {device.type} (compiled decoding targets CUDA; force_compile=True compiles anyway)"
    return True, ""


def _compile_config(config: FastGenerationConfig, device: torch.device):
    from transformers import CompileConfig

    mode = config.mode if config.backend == "inductor" else None
    cc = CompileConfig(fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend, mode=mode,
                       options=config.options)
    if device.type not in _COMPILE_DEVICES:
        cc._compile_all_devices = True  # transformers' own switch for compiling on e.g. CPU
    return cc


def cache_length(prompt_length: int, max_new_tokens: int, config: FastGenerationConfig) -> int:
    """The static cache length for a (padded) prompt length: bucketed, so it repeats across steps."""
    longest = max(prompt_length, config.max_prompt_length or 0)
    return _round_up(longest, config.bucket) + max_new_tokens


class StaticCachePool:
    """Static caches reused across generation calls, reset in place (same tensors, same addresses).

    transformers allocates a new ``StaticCache`` per ``generate`` call; its tensors are
    ``mark_static_address``-ed, so with CUDA graphs (``mode="reduce-overhead"``) every new address
    makes the graph re-record once per call (and each recording stays in the CUDA-graph tree). One
    cache per (batch, length), reset before each call, keeps one recording replayed for good.
    ``length`` is the high-water cache length: it never shrinks, so a shorter prompt reuses it.
    """

    def __init__(self) -> None:
        self.length = 0
        self.caches: dict[tuple[int, int], Any] = {}

    def grow(self, wanted: int) -> int:
        if wanted > self.length:
            self.length = wanted
            self.caches = {k: v for k, v in self.caches.items() if k[1] == wanted}
        return self.length

    def get(self, model: nn.Module, batch: int) -> Any:
        from transformers import StaticCache

        key = (batch, self.length)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = StaticCache(config=model.config, max_cache_len=self.length)
        else:
            cache.reset()
        return cache


def build_generation_config(base: Any, config: FastGenerationConfig, *, prompt_length: int,
                            device: torch.device | str, compiled: bool) -> Any:
    """A copy of ``base`` (TRL's ``GenerationConfig``) for fast sampling; ``base`` is not modified."""
    gc = copy.deepcopy(base)
    if not compiled:
        return gc  # eager: keep TRL's cache (a dynamic cache is the faster one without compilation)
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else max(gc.max_length - prompt_length, 1)
    gc.cache_implementation = "static"
    gc.disable_compile = False
    gc.compile_config = _compile_config(config, torch.device(device))
    gc.max_cache_len = max(cache_length(prompt_length, max_new, config), getattr(gc, "max_cache_len", None) or 0)
    return gc


@contextlib.contextmanager
def sampling_mode(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Every module in eval mode inside the block (no dropout of any kind); flags restored exactly."""
    if not enabled:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


_REQUIRE_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


@contextlib.contextmanager
def hidden_require_grad_hooks(model: nn.Module) -> Iterator[None]:
    """Hide the input-embedding ``requires_grad_`` hooks of gradient checkpointing while sampling.

    TRL disables and re-enables gradient checkpointing around every generation; on a PEFT model each
    enable registers one more ``make_inputs_require_grads`` forward hook on the input embeddings and
    the disable removes none (transformers 5.20 / PEFT 0.21: +2 hooks per GRPO step). Dynamo guards
    on the number of hooks, so the compiled decode step would recompile at every step and, after
    ``recompile_limit`` (8) steps, silently fall back to eager. Under ``no_grad`` these hooks do
    nothing useful, so they are left out for the duration of sampling and put back afterwards (the
    same dict objects: training sees exactly what it had).
    """
    swapped = []
    for module in model.modules():
        hooks = module._forward_hooks
        if hooks and any(getattr(fn, "__name__", "") in _REQUIRE_GRAD_HOOKS for fn in hooks.values()):
            kept = type(hooks)((k, fn) for k, fn in hooks.items()
                               if getattr(fn, "__name__", "") not in _REQUIRE_GRAD_HOOKS)
            swapped.append((module, hooks))
            module._forward_hooks = kept
    try:
        yield
    finally:
        for module, hooks in swapped:
            module._forward_hooks = hooks


class SampledLogprobs:
    """Logits processor recording ``log_softmax(scores / temperature)`` at the sampled tokens.

    transformers runs custom processors before its temperature / top-k / top-p warpers, so the
    scores seen here are the (penalized) logits; dividing by the temperature gives TRL's semantic
    (``add_fused_lm_head(temperature=...)``). The token sampled at step t is read at step t+1 from
    ``input_ids[:, -1]``; the last step's token is supplied by :meth:`finish`.
    """

    def __init__(self, temperature: float | None = 1.0) -> None:
        self.temperature = temperature if temperature else 1.0
        self._prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev is not None:
            self.steps.append(self._prev.gather(1, input_ids[:, -1:].to(self._prev.device)).squeeze(1))
        self._prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, completion_ids: list[list[int]]) -> list[list[float]]:
        """Per-row log-probs of ``completion_ids`` (rows cut after EOS, as TRL returns them)."""
        if self._prev is None:
            return [[] for _ in completion_ids]
        steps = [s.cpu() for s in self.steps]
        last = self._prev.cpu()
        total = len(steps) + 1
        out = []
        for i, ids in enumerate(completion_ids):
            row = [float(steps[j][i]) for j in range(min(len(ids), total - 1))]
            if len(ids) == total:
                row.append(float(last[i, ids[-1]]))
            out.append(row)
        self._prev, self.steps = None, []
        return out


def _graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # pragma: no cover
        return 0


@dataclass
class FastGenerationState:
    """What a trainer with fast generation carries (``trainer._grpo_patches_fast_generation``)."""

    config: FastGenerationConfig
    compiled: bool | None = None  # decided at the first call (the device is known then)
    reason: str = ""
    calls: int = 0
    graphs_compiled: int = 0  # dynamo graphs compiled during generation calls
    graphs_after_first_call: int = 0  # recompilations after warm-up (ideally 0)
    cache_length: int = 0  # the largest static cache length requested so far
    seconds: list[float] = field(default_factory=list)  # wall time of each generation call
    last_sampling_logprobs: list[list[float]] | None = None
    graph: GraphDecodeStats = field(default_factory=lambda: GraphDecodeStats())  # decode_loop="graph"
    pool: StaticCachePool = field(default_factory=StaticCachePool, repr=False)
    _active: bool = False

    def summary(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("_active", "last_sampling_logprobs", "pool"):
            d.pop(key, None)
        d["graph"] = dataclasses.asdict(self.graph)
        d["config"] = {k: (v if isinstance(v, str | int | float | bool | type(None)) else repr(v))
                       for k, v in dataclasses.asdict(self.config).items()}
        return d


def _sharding(trainer: Any) -> str | None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    return None


def _prompt_length(prompt_ids: Any, multiple: int | None) -> int:
    longest = max((len(p) for p in prompt_ids), default=1)
    return _round_up(longest, multiple) if multiple else longest


@contextlib.contextmanager
def _patched_attr(obj: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


# decode_loop="graph" ------------------------------------------------------------------------------

# generate() arguments the graph loop accepts only when unset (None / False)
_GENERATE_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                  "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                  "use_model_defaults", "custom_generate", "assistant_tokenizer", "tokenizer")
# generation-config fields the graph loop does not implement: each must hold one of its neutral values
_NEUTRAL: dict[str, tuple] = {
    "min_length": (None, 0), "min_new_tokens": (None, 0), "max_time": (None,), "stop_strings": (None,),
    "num_beams": (None, 1), "use_mtp": (None, False), "use_cache": (None, True), "min_p": (None,),
    "top_h": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "renormalize_logits": (None, False),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "sequence_bias": (None,), "token_healing": (None, False), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "num_return_sequences": (None, 1), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "output_scores": (None, False), "output_logits": (None, False),
    "return_dict_in_generate": (None, False), "encoder_no_repeat_ngram_size": (None, 0),
    "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,), "penalty_alpha": (None,),
    "dola_layers": (None,), "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1),
    "constraints": (None,), "force_words_ids": (None,), "prefill_chunk_size": (None,),
    "speculation_type": (None,), "is_assistant": (None, False),
}


@dataclass(frozen=True)
class _Sampler:
    """What one decode step needs to pick the next token (Python constants of the compiled step)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple[int, ...]
    pad: int


def _warp(logits: torch.Tensor, s: _Sampler) -> torch.Tensor:
    """fp32 scores after transformers' Temperature -> TopK -> TopP warpers (min_tokens_to_keep=1)."""
    scores = logits.float()
    if not s.do_sample:
        return scores
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(max(s.top_k, 1), scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)  # ties with the k-th are kept
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - s.top_p)
        remove[..., -1:] = False  # the most likely token is always kept
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -math.inf)
    return scores


def _pick(scores: torch.Tensor, s: _Sampler) -> torch.Tensor:
    """Greedy, or one sample of softmax(scores) (Gumbel-max: argmax(scores + Gumbel noise))."""
    if not s.do_sample:
        return scores.argmax(-1)
    u = torch.rand_like(scores).clamp_(min=torch.finfo(torch.float32).tiny)
    return (scores - torch.log(-torch.log(u))).argmax(-1)


def _eos_hit(tokens: torch.Tensor, s: _Sampler) -> torch.Tensor:
    hit = torch.zeros_like(tokens, dtype=torch.bool)
    for e in s.eos:
        hit = hit | (tokens == e)
    return hit


def _make_step(s: _Sampler) -> Callable:
    def graph_decode_step(model, cache, tokens, position_ids, cache_position, attention_mask, unfinished):
        out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                    cache_position=cache_position, past_key_values=cache, use_cache=True)
        nxt = _pick(_warp(out.logits[:, -1, :], s), s)
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.pad))
        return nxt, unfinished & ~_eos_hit(nxt, s)

    return graph_decode_step


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(sampler, compile key): step}


def _uses_cudagraphs(config: FastGenerationConfig) -> bool:
    if config.backend != "inductor":
        return False
    if config.options:
        return bool(config.options.get("triton.cudagraphs"))
    return config.mode in ("reduce-overhead", "max-autotune")


def _compiled_step(model: nn.Module, s: _Sampler, config: FastGenerationConfig) -> Callable:
    kwargs: dict[str, Any] = dict(backend=config.backend, fullgraph=config.fullgraph, dynamic=config.dynamic)
    if config.backend == "inductor":  # torch.compile takes a mode or options, not both
        if config.options:
            kwargs["options"] = config.options
        elif config.mode:
            kwargs["mode"] = config.mode
    key = (s, config.backend, kwargs.get("mode"), repr(kwargs.get("options")), config.fullgraph, config.dynamic)
    steps = _STEPS.setdefault(model, {})
    if key not in steps:
        steps[key] = torch.compile(_make_step(s), **kwargs)
    return steps[key]


def _as_ints(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten().tolist())
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def graph_decode_support(model: nn.Module, generation_config: Any, prompt_length: int,
                         kwargs: dict[str, Any]) -> tuple[_Sampler | None, int, str]:
    """``(sampler, max_new_tokens, "")`` if the graph loop implements this ``generate`` call exactly,
    else ``(None, 0, why)``. ``kwargs``: the call's other arguments (model inputs, processors...)."""
    kwargs = dict(kwargs)
    for name in _GENERATE_ARGS:
        value = kwargs.pop(name, None)
        if value is not None and value is not False and not (hasattr(value, "__len__") and len(value) == 0):
            return None, 0, f"generate(..., {name}=...) is not supported"
    try:
        gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses, its own path reports
        return None, 0, f"the generation config could not be resolved ({exc})"
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None and k != "use_cache"}
    if model_kwargs:
        return None, 0, f"generate arguments {sorted(model_kwargs)} are not supported"
    for name, neutral in _NEUTRAL.items():
        value = getattr(gc, name, None)
        if not any(value is n or (n is not None and value == n) for n in neutral):
            return None, 0, f"generation_config.{name}={value!r} is not supported"
    if gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    elif gc.max_length is not None:
        max_new = int(gc.max_length) - prompt_length
    else:
        return None, 0, "no max_new_tokens / max_length"
    if max_new < 1:
        return None, 0, f"max_new_tokens={max_new}"
    eos = _as_ints(gc.eos_token_id)
    pad = gc.pad_token_id
    if pad is None:
        if not eos:
            return None, 0, "neither pad_token_id nor eos_token_id is set"
        pad = eos[0]
    do_sample = bool(gc.do_sample)
    temperature = float(gc.temperature) if do_sample and gc.temperature is not None else 1.0
    top_k = int(gc.top_k) if do_sample and gc.top_k else 0
    top_p = float(gc.top_p) if do_sample and gc.top_p is not None else 1.0
    if do_sample and temperature <= 0:
        return None, 0, f"temperature={temperature}"
    return _Sampler(do_sample, temperature, top_k, top_p, eos, int(pad)), max_new, ""


@dataclass
class GraphDecodeStats:
    """Counters of the graph decode loop (per trainer state, or module-wide for ``fast_generate``)."""

    calls: int = 0  # generate calls the graph loop ran
    fallbacks: int = 0  # calls sent to the transformers loop (unsupported config)
    steps: int = 0  # compiled decode steps run
    last_reason: str = ""


GRAPH_STATS = GraphDecodeStats()  # fast_generate's counters


def _forward_kwargs(model: nn.Module) -> bool:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _graph_decode(model: nn.Module, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  s: _Sampler, max_new: int, config: FastGenerationConfig, stats: GraphDecodeStats) -> torch.Tensor:
    """Prefill eagerly, then one compiled step per token; returns what ``generate`` returns."""
    batch, prompt = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    length = cache.layers[0].max_cache_len if getattr(cache, "layers", None) else None
    if length is None or length < prompt + max_new - 1:
        raise ValueError(f"static cache of length {length} for {prompt} + {max_new} tokens")
    mask = torch.ones(batch, length, dtype=attention_mask.dtype, device=device)
    mask[:, :prompt] = attention_mask
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, 1)
    extra = {"logits_to_keep": 1} if _forward_kwargs(model) else {}
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                   cache_position=torch.arange(prompt, device=device), past_key_values=cache, use_cache=True,
                   **extra).logits[:, -1, :]
    first = _pick(_warp(logits, s), s)
    out = torch.full((batch, max_new), s.pad, dtype=input_ids.dtype, device=device)
    out[:, 0] = first
    tokens = first.view(batch, 1).to(input_ids.dtype)
    unfinished = ~_eos_hit(first, s)
    position_ids = attention_mask.long().sum(-1, keepdim=True)  # the first new token's position
    cache_position = torch.tensor([prompt], dtype=torch.long, device=device)
    step = _compiled_step(model, s, config)
    mark = torch.compiler.cudagraph_mark_step_begin if _uses_cudagraphs(config) else None
    for t in range(1, max_new):
        if mark is not None:
            mark()
        nxt, unf = step(model, cache, tokens, position_ids, cache_position, mask, unfinished)
        out[:, t].copy_(nxt)  # CUDA-graph outputs are overwritten by the next replay: copy now
        tokens.copy_(nxt.view(batch, 1))
        unfinished.copy_(unf)
        position_ids.add_(1)
        cache_position.add_(1)
        stats.steps += 1
        if t % config.check_every == 0 and not bool(unfinished.any()):
            break
    # generate's length: up to the step at which the last row ended (or max_new_tokens)
    ended = _eos_hit(out, s)
    first_end = torch.where(ended.any(-1), ended.int().argmax(-1), max_new - 1)
    new = int(first_end.max()) + 1 if s.eos else max_new
    stats.calls += 1
    return torch.cat([input_ids, out[:, :new]], dim=1)


def _pooled_generate(model: nn.Module, pool: StaticCachePool | None, **kwargs: Any) -> Any:
    """``model.generate`` on the pool's cache for this batch (reset here, once per call), or on
    whatever cache the call brings or transformers builds (``pool=None``)."""
    if pool is not None and kwargs.get("past_key_values") is None:
        kwargs["past_key_values"] = pool.get(model, kwargs["input_ids"].shape[0])
    return type(model).generate(model, **kwargs)


def _call_generate(model: nn.Module, pool: StaticCachePool | None, config: FastGenerationConfig,
                   stats: GraphDecodeStats, *, graph: bool, **inject: Any) -> Callable:
    """The ``generate`` one fast sampling call runs (``pool`` is None when decoding is not compiled):
    the graph loop, falling back to transformers' loop, or transformers' loop alone; transformers'
    loop decodes on the pooled cache when ``reuse_cache``."""
    plain = functools.partial(_pooled_generate, model, pool if pool is not None and config.reuse_cache else None,
                              **inject)
    if graph:
        return functools.partial(_graph_generate, model, pool=pool, config=config, stats=stats, fallback=plain)
    return plain


@contextlib.contextmanager
def _sampling(model: nn.Module, config: FastGenerationConfig, compiled: bool) -> Iterator[None]:
    """Dropout off (if configured) and, for compiled decoding, gradient checkpointing's hooks hidden."""
    hooks = hidden_require_grad_hooks(model) if compiled else contextlib.nullcontext()
    with sampling_mode(model, config.dropout_off_while_sampling), hooks:
        yield


def _graph_generate(model: nn.Module, *, pool: StaticCachePool, config: FastGenerationConfig,
                    stats: GraphDecodeStats, fallback: Callable, input_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, generation_config: Any = None,
                    **kwargs: Any) -> Any:
    """``model.generate`` replacement for one call: the graph loop, or ``fallback`` (warned once).

    The loop prefills from position 0, so a call that brings its own ``past_key_values`` (which may
    hold a prefix) goes to ``fallback``. Its cache is the pool's (``reuse_cache``: one reset per
    call) or a new static cache.
    """
    reason = ""
    if input_ids is None:
        reason = "no input_ids"
    elif kwargs.get("past_key_values") is not None:
        reason = "generate(..., past_key_values=...) is not supported"
    else:
        s, max_new, reason = graph_decode_support(model, generation_config, input_ids.shape[1], kwargs)
    if reason:
        stats.fallbacks += 1
        stats.last_reason = reason
        _warn_once(f"graph-fallback:{reason}",
                   f"grpo_patches fast_generation: decode_loop='graph' falls back to transformers' loop ({reason}).")
        return fallback(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                        **kwargs)
    kwargs.pop("past_key_values", None)
    length = pool.grow(cache_length(input_ids.shape[1], max_new, config))
    if config.reuse_cache:
        cache = pool.get(model, input_ids.shape[0])
    else:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=length)
    with torch.no_grad():
        return _graph_decode(model, cache, input_ids, attention_mask, s, max_new, config, stats)


def wrap_generate(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``GRPOTrainer._generate_single_turn`` (TRL 1.16).

    Signature there: ``(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)``.
    Only the regular transformers path is changed; trainers without fast generation enabled, vLLM
    and continuous batching run upstream's code untouched. ``decode_loop="graph"`` replaces TRL's
    ``unwrapped_model.generate`` for the call (counters on ``state.graph``).
    """
    state: FastGenerationState | None = getattr(instance, FAST_GEN_ATTR, None)
    if (state is None or state._active or getattr(instance, "use_vllm", False)
            or getattr(instance, "use_transformers_continuous_batching", False)):
        return wrapped(*args, **kwargs)
    prompt_ids = args[0] if args else kwargs["prompt_ids"]
    config = state.config
    model = instance.accelerator.unwrap_model(instance.model_wrapped)
    device = instance.accelerator.device
    if state.compiled is None:
        state.compiled, state.reason = compile_decision(device, config, sharded=_sharding(instance))
    if not state.compiled:
        _warn_once(
            f"eager:{state.reason}",
            f"grpo_patches fast_generation: decoding runs eagerly ({state.reason}); sampling still runs "
            f"with dropout off{' and bucketed prompts' if config.pad_prompts else ''}.",
        )
    trl_multiple = instance.pad_to_multiple_of
    multiple = trl_multiple
    if config.pad_prompts:
        multiple = math.lcm(trl_multiple or 1, config.bucket)
    prompt_length = _prompt_length(prompt_ids, multiple)
    gen_config = build_generation_config(instance.generation_config, config, prompt_length=prompt_length,
                                         device=device, compiled=state.compiled)
    inject: dict[str, Any] = {}
    if state.compiled:
        state.cache_length = state.pool.grow(gen_config.max_cache_len)
        gen_config.max_cache_len = state.cache_length
        if config.reuse_cache:  # the pooled cache is fetched per call, in _pooled_generate
            gen_config.cache_implementation = None  # transformers refuses both a cache and an implementation
    recorder = SampledLogprobs(gen_config.temperature) if config.record_sampling_logprobs else None
    if recorder is not None:
        from transformers import LogitsProcessorList

        inject["logits_processor"] = LogitsProcessorList([recorder])
    graph = state.compiled and config.decode_loop == "graph"
    if graph and recorder is not None:
        graph = False
        state.graph.fallbacks += 1
        _warn_once("graph-fallback:record", "grpo_patches fast_generation: decode_loop='graph' falls back to "
                   "transformers' loop (record_sampling_logprobs=True).")

    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(_patched_attr(instance, "generation_config", gen_config))
        if multiple != trl_multiple:
            stack.enter_context(_patched_attr(instance, "pad_to_multiple_of", multiple))
        if state.compiled or inject:  # TRL's call is `generate(**inputs, generation_config=...)`: ours, this call
            generate = _call_generate(model, state.pool if state.compiled else None, config, state.graph, graph=graph,
                                      **inject)
            stack.enter_context(_patched_attr(model, "generate", generate))
        stack.enter_context(_sampling(model, config, state.compiled))
        state._active = True
        stack.callback(setattr, state, "_active", False)
        before, start = _graphs(), time.perf_counter()
        completion_ids, logprobs = wrapped(*args, **kwargs)
        new_graphs = _graphs() - before
    state.seconds.append(time.perf_counter() - start)
    state.graphs_compiled += new_graphs
    if state.calls > 0 and new_graphs:
        state.graphs_after_first_call += new_graphs
        _warn_once(
            f"recompile:{state.cache_length}",
            f"grpo_patches fast_generation: decoding was recompiled after warm-up (static cache length now "
            f"{state.cache_length}; a longer prompt or a new batch size). Set FastGenerationConfig("
            f"max_prompt_length=...) to size the cache once.",
        )
    state.calls += 1
    if recorder is not None:
        state.last_sampling_logprobs = recorder.finish(completion_ids)
    return completion_ids, logprobs


def enable_fast_generation(trainer: Any, config: Any = True) -> FastGenerationState | None:
    """Turn fast generation on (or off, with ``False``) for one built ``GRPOTrainer``.

    Sets the state the wrapper reads; if the trainer's class is not already wrapped by
    ``grpo_patches.apply``, the instance's ``_generate_single_turn`` is wrapped (nesting is harmless:
    the wrapper passes through when it is already active).
    """
    cfg = FastGenerationConfig.coerce(config)
    if cfg is None:
        if hasattr(trainer, FAST_GEN_ATTR):
            delattr(trainer, FAST_GEN_ATTR)
        return None
    state = FastGenerationState(cfg)
    setattr(trainer, FAST_GEN_ATTR, state)
    if not _class_wrapped(type(trainer)) and "_generate_single_turn" not in vars(trainer):
        import wrapt

        wrapt.wrap_function_wrapper(trainer, "_generate_single_turn", wrap_generate)
    return state


def _class_wrapped(cls: type) -> bool:
    for klass in cls.__mro__:
        attr = vars(klass).get("_generate_single_turn")
        if attr is not None:
            return getattr(attr, "_self_wrapper", None) is wrap_generate
    return False


def fast_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  generation_config: Any = None, config: FastGenerationConfig | None = None,
                  logits_processor: Any = None, **kwargs: Any) -> torch.Tensor:
    """``model.generate`` the way the trainer wrapper runs it (standalone: benchmarks, tests).

    ``generation_config`` defaults to the model's; the fast copy gets the static cache, compile
    settings and the bucketed cache length; sampling runs in eval mode, flags restored. With
    ``config.decode_loop="graph"`` (and compiled decoding) the graph loop runs instead of
    ``model.generate`` where it supports the call (counters: ``GRAPH_STATS``).
    """
    config = config or FastGenerationConfig()
    base = generation_config if generation_config is not None else model.generation_config
    device = next(model.parameters()).device
    compiled, reason = compile_decision(device, config)
    if not compiled:
        _warn_once(f"eager:{reason}", f"grpo_patches fast_generation: decoding runs eagerly ({reason}).")
    if config.pad_prompts:
        input_ids, attention_mask = left_pad(input_ids, attention_mask, config.bucket,
                                             pad_token_id=base.pad_token_id or 0)
    gc = build_generation_config(base, config, prompt_length=input_ids.shape[1], device=device, compiled=compiled)
    pool = _POOLS.setdefault(model, StaticCachePool()) if compiled else None
    if compiled:
        gc.max_cache_len = pool.grow(gc.max_cache_len)
        if config.reuse_cache or kwargs.get("past_key_values") is not None:
            gc.cache_implementation = None  # transformers refuses both a cache and an implementation
    generate = _call_generate(model, pool, config, GRAPH_STATS, graph=compiled and config.decode_loop == "graph")
    with _sampling(model, config, compiled), torch.no_grad():
        return generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gc,
                        logits_processor=logits_processor, **kwargs)


def left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, multiple: int, *,
             pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad a batch to a multiple of ``multiple`` (pads get attention mask 0)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    extra = _round_up(input_ids.shape[1], multiple) - input_ids.shape[1]
    if extra == 0:
        return input_ids, attention_mask
    pad_ids = input_ids.new_full((input_ids.shape[0], extra), pad_token_id)
    pad_mask = attention_mask.new_zeros((attention_mask.shape[0], extra))
    return torch.cat([pad_ids, input_ids], dim=1), torch.cat([pad_mask, attention_mask], dim=1)
