"""Resolve: the run's settings as preflight reads them, from a GRPO config, a dict or a namespace.

The first stage of the pipeline (see :mod:`grpo_patches.preflight`): the model config (object, dict,
config.json, preset), the GRPO settings and their names, dtypes, the logits path of the installed TRL,
and the reward models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["PRESETS", "RewardModelSpec", "RunSettings", "as_bool", "as_choice", "as_number", "as_whole", "check_setting_names", "detect_logits_mode", "dtype_bytes", "dtype_name",
           "load_model_config", "resolve_settings", "reward_specs", "setting", "valid_setting_names"]

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}


#: Public architecture numbers, so `grpo-patches doctor --model llama-3.1-70b` needs no file.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}


@dataclasses.dataclass
class RewardModelSpec:
    """A learned reward model: its config (object, dict, config.json path or preset name), dtype and
    scoring chunk (completions per forward; None = one rank's generation batch)."""

    config: Any
    dtype: str = "bfloat16"
    batch_size: int | None = None
    name: str | None = None



# ----------------------------------------------------------------------------------- inputs


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_config_path(repo_id: str) -> Path:
    """The local path of a Hub model's ``config.json``: fetched (or read from the Hub cache, also offline)
    on its own, never the weights."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # no network, no such repo, gated: one line naming the id and the cause
        raise FileNotFoundError(
            f"grpo_patches.preflight: could not get config.json of the Hub model {repo_id!r} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); download it "
            f"(huggingface-cli download {repo_id} config.json) or give a local config.json path."
        ) from None


def load_model_config(model_config: Any) -> Any:
    """A transformers config from a config object, a dict, a config.json path / folder, a Hub model id
    (its config.json only) or a preset name."""
    import transformers

    if isinstance(model_config, transformers.PretrainedConfig):
        return model_config
    if isinstance(model_config, str) and model_config.lower() in PRESETS:
        model_config = PRESETS[model_config.lower()]
    if isinstance(model_config, (str, os.PathLike)):
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file() and isinstance(model_config, str) and _HUB_ID.fullmatch(model_config) \
                and not model_config.endswith(".json"):
            path = hub_config_path(model_config)
        if not path.is_file():
            raise FileNotFoundError(
                f"grpo_patches.preflight: no config at {str(model_config)!r}; give a config.json path, a folder "
                f"holding one, a Hub model id (owner/name), a transformers config object, or a preset "
                f"({', '.join(PRESETS)})."
            )
        model_config = json.loads(path.read_text())
    if isinstance(model_config, Mapping):
        d = dict(model_config)
        model_type = d.pop("model_type", None)
        if model_type is None:
            raise ValueError("grpo_patches.preflight: a config dict needs a 'model_type' (e.g. 'llama').")
        return transformers.AutoConfig.for_model(model_type, **d)
    raise TypeError(f"grpo_patches.preflight: cannot read a model config from {type(model_config).__name__}.")


def setting(cfg: Any, name: str, default: Any) -> Any:
    if cfg is None:
        return default
    value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
    return default if value is None else value


#: The GRPO settings preflight reads (also valid where the installed TRL lacks them, e.g. an older
#: release's max_prompt_length); any field of the installed ``trl.GRPOConfig`` is valid too.
_READ_SETTINGS = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
    "num_generations", "num_generations_eval", "max_completion_length", "max_prompt_length",
    "gradient_checkpointing", "bf16", "fp16", "model_init_kwargs", "optim", "eval_strategy",
    "per_device_eval_batch_size", "use_vllm", "ds3_gather_for_generation", "beta", "temperature", "top_k", "top_p",
})


def valid_setting_names() -> frozenset[str]:
    """GRPO setting names preflight and ``grpo-patches doctor --set`` accept."""
    try:
        import trl

        fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    except Exception:  # TRL absent or broken: the names preflight reads
        fields = set()
    return _READ_SETTINGS | fields


def check_setting_names(settings: Any) -> None:
    """Refuse a misspelt GRPO setting (a dict's keys or a namespace's attributes) with close matches.

    A built ``GRPOConfig`` (a dataclass) cannot carry unknown names, so it is not checked.
    """
    if settings is None or dataclasses.is_dataclass(settings):
        return
    names = list(settings) if isinstance(settings, Mapping) else list(vars(settings))
    valid = valid_setting_names()
    unknown = [n for n in names if n not in valid]
    if not unknown:
        return
    import difflib

    hints = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), sorted(valid), n=3, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    raise TypeError(
        f"grpo_patches.preflight: unknown GRPO setting(s) {', '.join(hints)}; use trl.GRPOConfig field names."
    )


def dtype_bytes(dtype: Any) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"grpo_patches.preflight: unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[key]


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def detect_logits_mode() -> str:
    try:
        from trl.trainer import utils as trl_utils
    except Exception:  # TRL absent or broken: assume the older, heavier path
        return "full"
    return "fused" if hasattr(trl_utils, "add_fused_lm_head") else "full"


def reward_specs(reward_models: Iterable[Any]) -> tuple[list[RewardModelSpec], int]:
    specs: list[RewardModelSpec] = []
    functions = 0
    for item in reward_models:
        if isinstance(item, RewardModelSpec):
            specs.append(item)
        elif isinstance(item, torch.nn.Module) and hasattr(item, "config"):  # a loaded model: its config, dtype
            dtype = next((p.dtype for p in item.parameters()), torch.bfloat16)
            specs.append(RewardModelSpec(config=item.config, dtype=dtype_name(dtype)))
        elif callable(item) and not isinstance(item, (str, os.PathLike, Mapping)) and not hasattr(item, "to_dict"):
            functions += 1  # a rule-based reward function: no GPU memory
        else:
            specs.append(RewardModelSpec(config=item))
    return specs, functions


# ------------------------------------------------------------------------------ values as typed

_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")


def _is_bool(value: Any) -> bool:
    """Python's bool or numpy's (whose scalars carry a dtype of kind "b")."""
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b"


def _bad(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"grpo_patches.preflight: {name}={value!r} is not valid; expected {expected}.")


def as_bool(name: str, value: Any) -> bool:
    """A yes/no setting as a user may type it: a bool (numpy's too), 0 / 1, or a word ("False", "true", "no")."""
    if _is_bool(value):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS + _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise _bad(name, value, f"true or false (or one of {', '.join(_TRUE_WORDS + _FALSE_WORDS)})")


def as_whole(name: str, value: Any, minimum: int, why: str = "") -> int:
    """A count as a user may type it: an integer (numpy's too), a float or a string holding a whole number;
    a fraction is refused, never cut."""
    expected = f"a whole number >= {minimum}{why}"
    number: Any = value
    if isinstance(value, str):
        try:
            number = float(value.strip()) if any(c in value for c in ".eE") else int(value.strip())
        except ValueError:
            raise _bad(name, value, expected) from None
    if _is_bool(number):
        raise _bad(name, value, expected)
    integral = isinstance(number, numbers.Integral) or (
        isinstance(number, numbers.Real) and math.isfinite(number) and float(number).is_integer())
    if not integral:
        raise _bad(name, value, expected)
    whole = int(number)
    if whole < minimum:
        raise _bad(name, value, expected)
    return whole


def as_number(name: str, value: Any, *, minimum: float, inclusive: bool = True) -> float:
    """A finite real number (numpy's too, or a string holding one) at or above ``minimum`` (above, if not inclusive)."""
    expected = f"a number {'>=' if inclusive else '>'} {minimum:g}"
    number: Any = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _bad(name, value, expected) from None
    if (_is_bool(number) or not isinstance(number, numbers.Real)
            or not math.isfinite(number) or not (number >= minimum if inclusive else number > minimum)):
        raise _bad(name, value, expected)
    return float(number)


def as_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """One of ``choices`` (a str enum compares by its value)."""
    plain = getattr(value, "value", value)
    if plain not in choices:
        raise _bad(name, value, "one of " + ", ".join(repr(c) for c in choices))
    return plain


# ------------------------------------------------------------------------------------- resolve


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run's settings, resolved once: every later stage reads them from here."""

    world_size: int
    batch: int  # per_device_train_batch_size
    accumulation: int  # gradient_accumulation_steps
    steps: int  # steps_per_generation
    num_generations: int
    prompt: int  # prompt tokens
    completion: int  # completion tokens
    checkpointing: bool
    compute_dtype: str
    dtype: Any  # the frozen policy weights' dtype
    optim: str
    logits_mode: str
    reward_placement: str
    lora: Any
    dropout: bool  # LoRA dropout > 0
    eval_shape: tuple[int, int] | None  # (per_device_eval_batch_size, num_generations_eval) when evaluating
    gather_for_generation: bool  # ds3_gather_for_generation
    use_vllm: bool
    sampler: tuple[float, int, float] = (1.0, 0, 1.0)  # temperature, top_k, top_p

    @property
    def w_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def act(self) -> int:
        return dtype_bytes(self.compute_dtype)


def resolve_settings(
    grpo_config: Any,
    *,
    lora_config: Any,
    world_size: int,
    gpu_memory_gb: float | None,
    reward_placement: str,
    prompt_length: int | None,
    dtype: Any,
    logits_mode: str,
) -> RunSettings:
    """Check preflight's arguments and read the GRPO settings (the pinned defaults where one is missing)."""
    from grpo_patches.defaults import PINNED_TRAINING_SETTINGS
    from grpo_patches.defaults import lora_config as default_lora
    from grpo_patches.grouping import resolve_steps_per_generation

    reward_placement = as_choice("reward_placement", reward_placement, ("local", "main"))
    world_size = as_whole("world_size", world_size, 1)
    if gpu_memory_gb is not None:
        as_number("gpu_memory_gb", gpu_memory_gb, minimum=0, inclusive=False)
    logits_mode = as_choice("logits_mode", logits_mode, ("auto", "fused", "full"))

    g = grpo_config
    check_setting_names(g)
    art = PINNED_TRAINING_SETTINGS

    def whole(name: str, default: Any, minimum: int = 1, why: str = "") -> Any:
        value = setting(g, name, default)
        return None if value is None else as_whole(name, value, minimum, why)

    def flag(name: str, default: bool) -> bool:
        return as_bool(name, setting(g, name, default))

    batch = whole("per_device_train_batch_size", art["per_device_train_batch_size"])
    accum = whole("gradient_accumulation_steps", art["gradient_accumulation_steps"])
    if g is not None and not isinstance(g, Mapping) and not hasattr(g, "steps_per_generation"):
        steps = 1  # a TRL < 0.19 config: every micro-batch generates its own groups
    else:
        steps = resolve_steps_per_generation(
            {"per_device_train_batch_size": batch, "gradient_accumulation_steps": accum,
             "steps_per_generation": whole("steps_per_generation", None),
             "generation_batch_size": whole("generation_batch_size", None)}
            if isinstance(g, Mapping) or g is None else g,
            world_size=world_size)
    num_gen = whole("num_generations", art["group_size"], 2, " (GRPO normalizes rewards within a group; TRL refuses 1)")
    completion = whole("max_completion_length", art["max_length"] // 2)
    prompt = (as_whole("prompt_length", prompt_length, 1) if prompt_length is not None
              else whole("max_prompt_length", art["max_length"] // 2))
    checkpointing = flag("gradient_checkpointing", art["gradient_checkpointing"])
    bf16 = flag("bf16", True) if g is not None else True
    fp16 = flag("fp16", False)
    compute_dtype = "bfloat16" if bf16 else ("float16" if fp16 else "float32")
    init_kwargs = setting(g, "model_init_kwargs", {}) or {}
    if isinstance(init_kwargs, str):  # a command line's JSON text, as transformers' argument parser takes it
        with contextlib.suppress(ValueError):
            init_kwargs = json.loads(init_kwargs)
    if not isinstance(init_kwargs, Mapping):
        raise _bad("model_init_kwargs", init_kwargs, "a dict of from_pretrained keyword arguments, e.g. {'dtype': 'bfloat16'}")
    if dtype is None:
        dtype = init_kwargs.get("dtype") or init_kwargs.get("torch_dtype")
        if dtype in (None, "auto"):
            dtype = compute_dtype
    dtype_bytes(dtype)  # an unknown dtype is refused here, before anything is counted
    optim = setting(g, "optim", art["optim"])
    optim = getattr(optim, "value", optim)  # OptimizerNames is a str enum
    if not isinstance(optim, str):
        raise _bad("optim", optim, "an optimizer name such as 'adamw_torch' or 'adamw_8bit'")
    mode = detect_logits_mode() if logits_mode == "auto" else logits_mode
    lora = default_lora() if lora_config is None else lora_config
    dropout = float(getattr(lora, "lora_dropout", 0.0) or 0.0) > 0
    temperature = as_number("temperature", setting(g, "temperature", art["temperature"]), minimum=0, inclusive=False)
    # a GRPOConfig without the field (TRL < 0.19) samples without top-p; elsewhere a missing one is the pinned
    no_top_p = dataclasses.is_dataclass(g) and not hasattr(g, "top_p")
    top_p = as_number("top_p", 1.0 if no_top_p else setting(g, "top_p", art["top_p"]), minimum=0)  # [0, 1]
    if top_p > 1:
        raise _bad("top_p", top_p, "a number in [0, 1], e.g. 0.9 (1.0: no top-p)")
    top_k = whole("top_k", 0, 0) or 0
    eval_shape = None
    if as_choice("eval_strategy", setting(g, "eval_strategy", "no"), ("no", "steps", "epoch")) != "no":
        eval_shape = (whole("per_device_eval_batch_size", 8), whole("num_generations_eval", num_gen))
    return RunSettings(
        world_size=world_size, batch=batch, accumulation=accum, steps=steps, num_generations=num_gen, prompt=prompt,
        completion=completion, checkpointing=checkpointing, compute_dtype=compute_dtype, dtype=dtype, optim=optim,
        logits_mode=mode, reward_placement=reward_placement, lora=lora, dropout=dropout, eval_shape=eval_shape,
        gather_for_generation=flag("ds3_gather_for_generation", True), use_vllm=flag("use_vllm", False),
        sampler=(float(temperature), int(top_k), float(top_p)),
    )
