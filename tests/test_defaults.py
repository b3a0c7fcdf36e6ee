"""Pinned LoRA / GRPO defaults: real config objects, field mapping, validation, memory settings."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types
import warnings

import peft
import pytest
import torch
import trl
from torch.utils.checkpoint import checkpoint

from grpo_patches import defaults
from grpo_patches.defaults import DefaultsWarning, apply_lora, grpo_config, lora_config
from grpo_patches.grouping import GroupShapeError
from tests.helpers import tiny_policy

GRPO_FIELDS = {f.name for f in dataclasses.fields(trl.GRPOConfig)}


def build(tmp_path, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DefaultsWarning)
        return grpo_config(str(tmp_path / "out"), **overrides)


# -------------------------------------------------------------------------------------- LoRA (S4)


def test_lora_config_is_the_pinned_peft_config():
    cfg = lora_config()
    assert isinstance(cfg, peft.LoraConfig)
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.bias) == (16, 32, 0.05, "none")
    assert set(cfg.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert cfg.task_type == "CAUSAL_LM" and cfg.inference_mode is False


def test_lora_overrides_apply():
    cfg = lora_config(r=8, lora_alpha=16, target_modules=["q_proj"])
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (8, 16, {"q_proj"})


def test_lora_unknown_setting_lists_valid_names():
    with pytest.raises(TypeError, match="rank") as e:
        lora_config(rank=8)
    assert "lora_alpha" in str(e.value) and "target_modules" in str(e.value)


@pytest.mark.parametrize(("name", "value", "needle"), [
    ("r", 0, ">= 1"), ("r", -4, ">= 1"), ("r", 2.5, ">= 1"), ("lora_alpha", 0, "> 0"),
    ("lora_dropout", 1.0, "[0, 1)"), ("lora_dropout", -0.1, "[0, 1)"), ("target_modules", [], "no module"),
    ("bias", "some", "'none'"),
])
def test_lora_bad_values_name_value_and_range(name, value, needle):
    with pytest.raises(ValueError) as e:
        lora_config(**{name: value})
    assert name in str(e.value) and needle in str(e.value)


def test_apply_lora_freezes_base_and_enables_input_grads():
    # Enable reentrant checkpointing *after* wrapping, the way a trainer does: without input grads the
    # recomputed segment has nothing requiring grad (TRL #3089 / #3150).
    def train_step(model):
        model.get_base_model()._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=True))
        model.train()
        ids = torch.randint(0, 19, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for n, p in model.named_parameters() if "lora_" in n]

    wrapped = apply_lora(tiny_policy(use_cache=False), args=types.SimpleNamespace(gradient_checkpointing=True))
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(g is not None for g in train_step(wrapped))

    plain = peft.get_peft_model(tiny_policy(use_cache=False), lora_config())
    with pytest.raises(RuntimeError, match="does not require grad"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_step(plain)


# ----------------------------------------------------------------------------------- GRPO (S6)


def test_grpo_config_is_a_trl_config_with_the_article_settings(tmp_path):
    cfg = build(tmp_path)
    assert isinstance(cfg, trl.GRPOConfig)
    assert cfg.num_generations == 4 and cfg.temperature == 0.7 and cfg.top_p == 0.9
    assert cfg.learning_rate == 1e-5 and cfg.per_device_train_batch_size == 1
    assert cfg.gradient_accumulation_steps == 4 and cfg.num_train_epochs == 3 and cfg.warmup_steps == 50
    assert cfg.lr_scheduler_type == "cosine" and cfg.optim == "adamw_torch"
    assert cfg.max_completion_length == 256
    if "max_prompt_length" in GRPO_FIELDS:
        assert cfg.max_prompt_length == 256
    if "entropy_coef" in GRPO_FIELDS:
        assert cfg.entropy_coef == 0.01


def test_memory_settings_for_this_machine(tmp_path):
    cfg = build(tmp_path)
    assert cfg.gradient_checkpointing is True
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert cfg.ddp_find_unused_parameters is False  # PEFT + checkpointing + DDP (fails on TRL 0.23 / 0.26 otherwise)
    assert build(tmp_path, gradient_checkpointing=False).ddp_find_unused_parameters is False  # no graph walk either
    assert build(tmp_path, ddp_find_unused_parameters=True).ddp_find_unused_parameters is True  # the caller's choice
    assert cfg.bf16 is bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert build(tmp_path, bf16=True, use_cpu=True).bf16 is True  # an explicit choice is kept


def test_bf16_follows_the_launchers_mixed_precision_under_deepspeed(tmp_path, monkeypatch):
    # accelerate launch --config_file zero2.yaml: DeepSpeed's bf16 comes from mixed_precision, and
    # Trainer refuses a bf16 that differs from it ("ds bf16.enabled=True vs hf bf16 ...").
    # (a field-only GRPOConfig: the real one would import deepspeed under ACCELERATE_USE_DEEPSPEED)
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(GRPOConfig=NewGRPOConfig, __version__="1.16.0"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert build(tmp_path).bf16 is True
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert build(tmp_path).bf16 is False
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # DDP without mixed precision: what the device can do
    assert build(tmp_path).bf16 is bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def test_peft_with_zero3_gets_reentrant_checkpointing(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "_zero_stage", lambda deepspeed: 3)
    assert build(tmp_path).gradient_checkpointing_kwargs == {"use_reentrant": True}
    assert build(tmp_path, gradient_checkpointing_kwargs={"use_reentrant": False}).gradient_checkpointing_kwargs == {
        "use_reentrant": False}  # the caller's choice wins


def test_zero_stage_is_read_from_dict_file_and_accelerate_env(tmp_path, monkeypatch):
    assert defaults._zero_stage({"zero_optimization": {"stage": 3}}) == 3
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert defaults._zero_stage(str(path)) == 2
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert defaults._zero_stage(None) is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert defaults._zero_stage(None) == 3


def test_missing_fields_are_named_in_a_warning_not_faked(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = grpo_config(str(tmp_path / "o"), reward_baseline=0.5)
    messages = [str(w.message) for w in caught if issubclass(w.category, DefaultsWarning)]
    assert len(messages) == 1 and "reward_baseline=0.5" in messages[0]
    assert not hasattr(cfg, "reward_baseline")
    assert "max_prompt_length" not in messages[0] and "entropy_coef" not in messages[0]  # pinned, not the caller's


def test_the_pinned_defaults_fit_the_installed_release_without_a_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_config(str(tmp_path / "o"))
    assert [str(w.message) for w in caught if issubclass(w.category, DefaultsWarning)] == []


def test_a_field_the_caller_set_that_the_release_lacks_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(GRPOConfig=NewGRPOConfig, __version__="1.16.0"))
    for chosen in ({"max_prompt_length": 128}, {"max_length": 1024}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = grpo_config(str(tmp_path), **chosen)
        messages = " ".join(str(w.message) for w in caught if issubclass(w.category, DefaultsWarning))
        assert "max_prompt_length=" in messages and "TRL 1.16.0 has no field" in messages, chosen
        assert cfg.max_prompt_length is None  # not passed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_config(str(tmp_path))
    assert not [w for w in caught if issubclass(w.category, DefaultsWarning)]


@dataclasses.dataclass
class OldGRPOConfig:
    """The GRPOConfig fields of a TRL 0.15-era release: no steps_per_generation, top_p, entropy_coef."""

    output_dir: str
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    logging_steps: float = 500
    save_steps: float = 500
    eval_steps: float | None = None
    optim: str = "adamw_torch"
    lr_scheduler_type: str = "linear"
    bf16: bool = False
    tf32: bool | None = None
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict | None = None
    ddp_find_unused_parameters: bool | None = None
    num_generations: int = 8
    temperature: float = 0.9
    max_prompt_length: int = 512
    max_completion_length: int = 256


@dataclasses.dataclass
class NewGRPOConfig(OldGRPOConfig):
    """The GRPOConfig fields of a TRL 0.28+ release that matter here: no max_prompt_length."""

    steps_per_generation: int = 4  # TRL sets it to gradient_accumulation_steps
    top_p: float = 1.0
    entropy_coef: float = 0.0
    max_prompt_length: None = dataclasses.field(default=None, init=False)


def test_fields_are_mapped_onto_the_installed_release(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(GRPOConfig=OldGRPOConfig, __version__="0.15.2"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = grpo_config(str(tmp_path))
    messages = " ".join(str(w.message) for w in caught if issubclass(w.category, DefaultsWarning))
    assert isinstance(cfg, OldGRPOConfig)
    assert (cfg.num_generations, cfg.max_prompt_length, cfg.max_completion_length) == (4, 256, 256)
    assert cfg.per_device_train_batch_size == 4  # a batch of 1 cannot hold a group without steps_per_generation
    assert "per_device_train_batch_size=4 instead of 1" in messages
    assert "TRL 0.15.2" in messages
    assert "top_p" not in messages and "entropy_coef" not in messages  # pinned defaults it lacks: left out silently
    assert not hasattr(cfg, "top_p") and not hasattr(cfg, "entropy_coef")
    with pytest.raises(TypeError, match="steps_per_generation"):
        grpo_config(str(tmp_path), steps_per_generation=4)


def test_zero_reward_baseline_is_not_reported(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_config(str(tmp_path / "o"))
    assert not any("reward_baseline" in str(w.message) for w in caught)


def test_article_names_and_max_length_split(tmp_path):
    assert build(tmp_path, group_size=8, per_device_train_batch_size=2).num_generations == 8
    assert build(tmp_path, max_length=1024).max_completion_length == 512
    assert build(tmp_path, max_length=1024, max_prompt_length=768).max_completion_length == 256
    assert build(tmp_path, max_completion_length=64).max_completion_length == 64
    with pytest.raises(TypeError, match="not both"):
        build(tmp_path, group_size=4, num_generations=4)


def test_unknown_setting_lists_valid_names(tmp_path):
    with pytest.raises(TypeError, match="num_generation") as e:
        build(tmp_path, num_generation=4)
    assert "num_generations" in str(e.value) and "group_size" in str(e.value)


@pytest.mark.parametrize(("name", "value", "needle"), [
    ("num_generations", 1, ">= 2"), ("group_size", 0, ">= 2"), ("temperature", 0.0, "> 0"),
    ("top_p", 1.5, "(0, 1]"), ("learning_rate", -1e-5, "> 0"), ("max_length", 0, ">= 2"),
    ("max_completion_length", 0, ">= 1"), ("per_device_train_batch_size", 0, ">= 1"),
    ("entropy_coef", -0.1, ">= 0"),
])
def test_bad_values_name_value_and_range(tmp_path, name, value, needle):
    with pytest.raises(ValueError) as e:
        build(tmp_path, **{name: value})
    shown = "num_generations" if name == "group_size" else name
    assert shown in str(e.value) and needle in str(e.value)


def test_split_groups_are_rejected_before_trl_sees_them(tmp_path, monkeypatch):
    with pytest.raises(GroupShapeError, match="Nearest valid settings"):
        build(tmp_path, num_generations=3)  # 1 x 4 completions per rank, groups of 3
    monkeypatch.setenv("WORLD_SIZE", "2")  # TRL checks 2 x 2 = 4 globally and would accept this
    with pytest.raises(GroupShapeError, match="world_size=2"):
        defaults._check_settings_group_shape(
            dict(per_device_train_batch_size=2, steps_per_generation=1, gradient_accumulation_steps=1,
                 num_generations=4), GRPO_FIELDS)
