"""Preflight's resolve stage: settings as a user types them mean what they say; bad ones are refused
up front, naming the setting, its value and what it may be (``grpo-patches doctor --set``, dicts,
``preflight(...)`` keyword arguments)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_patches.cli import main as cli_main
from grpo_patches.preflight import preflight
from grpo_patches.preflight.settings import resolve_settings

BOOL_WORDS = {"true": True, "True": True, "yes": True, "on": True, "1": True,
              "false": False, "False": False, "FALSE": False, "no": False, "off": False, "0": False}


def resolve(**grpo):
    return resolve_settings(grpo, lora_config=None, world_size=1, gpu_memory_gb=None, reward_placement="local",
                            prompt_length=None, dtype=None, logits_mode="full")


def doctor(capsys, *sets):
    argv = ["doctor", "--model", "qwen2.5-0.5b"]
    for kv in sets:
        argv += ["--set", kv]
    code = cli_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------ the listed cases


def test_doctor_false_word_turns_checkpointing_off(capsys):
    code, out, _ = doctor(capsys, "gradient_checkpointing=False", "per_device_train_batch_size=4", "num_generations=4")
    assert code == 0 and "gradient_checkpointing=False" in out
    off = preflight("qwen2.5-0.5b", grpo_config={"gradient_checkpointing": False, "per_device_train_batch_size": 4,
                                                 "num_generations": 4}, warn=False)
    assert f"activations {off.ranks[0].components['activations'] / 2**30:.2f}" in " ".join(out.split())


def test_doctor_refuses_a_fractional_batch_instead_of_cutting_it(capsys):
    code, out, err = doctor(capsys, "per_device_train_batch_size=2.5")
    assert code == 2 and not out
    assert "per_device_train_batch_size=2.5" in err and "whole number >= 1" in err


def test_doctor_refuses_a_group_of_one_as_trl_does(capsys):
    code, _, err = doctor(capsys, "num_generations=1")
    assert code == 2 and "num_generations=1" in err and ">= 2" in err


def test_doctor_names_the_setting_of_a_word_where_a_number_goes(capsys):
    code, _, err = doctor(capsys, "per_device_train_batch_size=abc")
    assert code == 2 and "per_device_train_batch_size='abc'" in err


@pytest.mark.parametrize("kv", ["model_init_kwargs=5", "fp16=maybe", "eval_strategy=sometimes", "optim=5",
                                "max_completion_length=-5", "gradient_accumulation_steps=0"])
def test_doctor_bad_values_exit_2_with_their_name_not_a_traceback(capsys, kv):
    code, out, err = doctor(capsys, kv)
    assert code == 2 and not out
    assert err.startswith("grpo-patches doctor: error:") and kv.split("=")[0] in err


def test_keyword_arguments_take_numpy_scalars_and_words():
    plain = preflight("qwen2.5-0.5b", world_size=2, gpu_memory_gb=24.0, lean_lora=False,
                      grpo_config={"per_device_train_batch_size": 4, "num_generations": 4}, warn=False)
    typed = preflight("qwen2.5-0.5b", world_size=np.int64(2), gpu_memory_gb=np.float32(24), lean_lora="false",
                      grpo_config={"per_device_train_batch_size": np.int32(4), "num_generations": "4"}, warn="no")
    assert typed.ranks == plain.ranks and typed.settings == plain.settings


@pytest.mark.parametrize(("kwarg", "value"), [("world_size", 1.5), ("gpu_memory_gb", "lots"), ("gpu_memory_gb", 0),
                                              ("lean_lora", "maybe"), ("sharding", "zero4"), ("dataset_size", -1),
                                              ("fragmentation", float("nan")), ("quantization", "fp4")])
def test_bad_keyword_arguments_are_refused_with_their_name(kwarg, value):
    with pytest.raises(ValueError, match=rf"{kwarg}="):
        preflight("qwen2.5-0.5b", warn=False, **{kwarg: value})


# ------------------------------------------------------------------- any value a user can type


def _typed():
    return st.one_of(
        st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
        st.sampled_from(sorted(BOOL_WORDS)), st.text(max_size=6),
        st.integers(-5, 10**6).map(str), st.floats(-5, 1e4).map(repr),
        st.integers(0, 100).map(np.int64), st.floats(0, 100).map(np.float32), st.booleans().map(np.bool_),
    )


def _whole(value):
    """The whole number a typed value denotes, or None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return None
    v = float(value)
    return int(v) if math.isfinite(v) and v.is_integer() else None


@settings(max_examples=300, deadline=None)
@given(value=_typed(), name=st.sampled_from(["per_device_train_batch_size", "max_completion_length",
                                              "max_prompt_length", "num_generations"]))
def test_counts_are_taken_exactly_or_refused_by_name(value, name):
    minimum = 2 if name == "num_generations" else 1
    expected = _whole(value)
    field = {"per_device_train_batch_size": "batch", "max_completion_length": "completion",
             "max_prompt_length": "prompt", "num_generations": "num_generations"}[name]
    grpo = {"steps_per_generation": 1, name: value}  # the group rule is the advise stage's, not checked here
    if expected is None or expected < minimum:
        with pytest.raises(ValueError, match=rf"{name}="):
            resolve(**grpo)
        return
    s = resolve(**grpo)
    assert getattr(s, field) == expected


@settings(max_examples=200, deadline=None)
@given(value=_typed(), name=st.sampled_from(["gradient_checkpointing", "bf16", "use_vllm", "ds3_gather_for_generation"]))
def test_yes_no_settings_mean_what_they_say_or_are_refused_by_name(value, name):
    field = {"gradient_checkpointing": "checkpointing", "use_vllm": "use_vllm",
             "ds3_gather_for_generation": "gather_for_generation", "bf16": "compute_dtype"}[name]
    if isinstance(value, (bool, np.bool_)):
        expected = bool(value)
    elif isinstance(value, str):
        expected = BOOL_WORDS.get(value.strip().lower(), BOOL_WORDS.get(value.strip()))
    elif isinstance(value, (int, np.integer)) and value in (0, 1):
        expected = bool(value)
    else:
        expected = None
    if expected is None:
        with pytest.raises(ValueError, match=rf"{name}="):
            resolve(**{name: value})
        return
    got = getattr(resolve(**{name: value}), field)
    assert got == (("bfloat16" if expected else "float32") if name == "bf16" else expected)
