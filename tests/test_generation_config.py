"""generation.config: FastGenerationConfig refuses wrong values and types at construction, naming
the field, the value and the fix."""

from __future__ import annotations

import pytest

from grpo_patches.generation import FastGenerationConfig
from tests.fastgen_helpers import _fresh  # noqa: F401  (_fresh: autouse)


def test_decode_loop_config_validation():
    assert FastGenerationConfig().decode_loop == "graph" and FastGenerationConfig().check_every == 16
    assert FastGenerationConfig.coerce({"decode_loop": "graph"}).decode_loop == "graph"
    with pytest.raises(ValueError):
        FastGenerationConfig(decode_loop="cuda")
    with pytest.raises(ValueError):
        FastGenerationConfig(check_every=0)


@pytest.mark.parametrize("name", ["pad_prompts", "dropout_off_while_sampling", "compile", "force_compile", "fullgraph",
                                  "reuse_cache", "record_sampling_logprobs", "merge_lora", "release_after_sampling",
                                  "fused_decode", "keep_graph"])
def test_config_bool_fields_refuse_non_bools_naming_field_value_and_fix(name):
    for bad in ("no", 0, 1, None):
        with pytest.raises(TypeError) as err:
            FastGenerationConfig(**{name: bad})
        text = str(err.value)
        assert f"{name}={bad!r}" in text and f"{name}=False" in text, text
    with pytest.raises(TypeError, match=name):  # through apply()'s dict form too
        FastGenerationConfig.coerce({name: "no"})
    assert getattr(FastGenerationConfig(**{name: False}), name) is False


def test_config_other_fields_are_type_checked():
    with pytest.raises(TypeError, match=r"dropout_of_while_sampling.*Did you mean dropout_off_while_sampling"):
        FastGenerationConfig.coerce({"dropout_of_while_sampling": False})
    for field, bad in (("mode", 3), ("dynamic", "no"), ("options", "x"), ("backend", 3)):
        with pytest.raises(TypeError, match=f"{field}={bad!r}"):
            FastGenerationConfig(**{field: bad})
    for field, bad in (("bucket", "64"), ("check_every", True), ("max_prompt_length", 0), ("decode_loop", None)):
        with pytest.raises(ValueError, match=field):
            FastGenerationConfig(**{field: bad})
