"""The layouts' byte counts against the libraries themselves, on CPU.

- FSDP2: ``fully_shard`` over gloo, 2 processes; the per-rank shards and torch's own
  ``FSDPMemTracker`` (unsharded parameters + all-gather buffers while each layer runs).
- DeepSpeed ZeRO-2 / ZeRO-3 (CPU accelerator, gloo, 2 processes): each parameter's partition
  (``ds_tensor``), a real forward / backward / step, and (ZeRO-3) the frozen parameters DeepSpeed
  holds gathered at each matmul of the forward (trace-recording mode: module by module), and the
  persistent parameters (``stage3_param_persistence_threshold``) whole on every rank.
- bitsandbytes nf4 (double quantization) and int8: a model loaded through transformers'
  ``BitsAndBytesConfig`` on CPU, every stored tensor counted (data, absmax, codes, row scales).

DeepSpeed and bitsandbytes are not in the test extra (DeepSpeed compiles a CPU op on first use, a
minute or more): their tests run in ``nox -s layouts`` (extra ``layouts``), which .ci/run runs.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo_patches.preflight import count_parameters, preflight
from grpo_patches.preflight.layout import DeepSpeedSettings, Layout
from tests.launch import describe, run_ranks
from tests.workers.layouts_worker import CONFIG

NEEDS = {name: importlib.util.find_spec(name) is None for name in ("deepspeed", "bitsandbytes")}


def _ranks(mode: str) -> list[dict]:
    results = run_ranks("tests.workers.layouts_worker", mode, world_size=2, deadline=420)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [r.data for r in results]


@pytest.mark.distributed
def test_fsdp2_shards_and_working_set_match_fully_shard():
    counts = count_parameters(CONFIG)
    layout = Layout("fsdp2")
    for data in _ranks("fsdp2"):
        assert data["frozen_shard_bytes"] == layout.gpu_weights(counts, 2, 2)
        assert data["lora_shard_bytes"] == 4 * counts.trainable // 2
        b = layout.base_bytes(counts, 2)
        layer = b["layer"] + data["layer_lora_bytes"]
        # forward: the first layer's gather overlaps the root's buffer; backward: root + 2 layers
        assert data["gathered_forward"] == pytest.approx(2 * b["root"] + layer, rel=0.01)
        assert data["gathered_backward"] == pytest.approx(b["root"] + 2 * layer, rel=0.01)
        assert layout.gathered(counts, 2, 2, 64, "training") == pytest.approx(
            max(data["gathered_forward"], data["gathered_backward"]), rel=0.01)


@pytest.mark.distributed
@pytest.mark.skipif(NEEDS["deepspeed"], reason="deepspeed not installed: runs in `nox -s layouts`")
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_partitions_match_deepspeed(stage):
    counts = count_parameters(CONFIG)
    for data in _ranks(f"zero{stage}"):
        layout = Layout(f"zero{stage}", ds=DeepSpeedSettings.from_config(data["ds_config"], CONFIG["hidden_size"]))
        # every partition (ds_tensor) + the persistent parameters whole (stage3_param_persistence_threshold)
        assert layout.persistent_bytes(counts, 2) == data["persistent_bytes"]
        assert data["frozen_shard_bytes"] + data["persistent_bytes"] == layout.gpu_weights(counts, 2, 2)
        assert torch.isfinite(torch.tensor(data["loss"]))
        if stage == 3:  # a forward in trace-recording mode, no checkpointing: module by module
            assert data["gathered"] > 0
            assert layout.gathered(counts, 2, 2, CONFIG["hidden_size"], "training", checkpointing=False) == \
                pytest.approx(data["gathered"], rel=0.15)


@pytest.mark.skipif(NEEDS["bitsandbytes"], reason="bitsandbytes not installed: runs in `nox -s layouts`")
@pytest.mark.parametrize(("quantization", "double_quant"), [("nf4", True), ("nf4", False), ("int8", False)])
def test_quantized_base_bytes_match_bitsandbytes(tmp_path, quantization, double_quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from grpo_patches.preflight import load_model_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(CONFIG), dtype=torch.bfloat16).save_pretrained(tmp_path)
    kw = (dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
               bnb_4bit_compute_dtype=torch.bfloat16) if quantization == "nf4" else dict(load_in_8bit=True))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(**kw),
                                                 dtype=torch.bfloat16, device_map="cpu")
    stored = 0
    for p in {id(p): p for p in model.parameters()}.values():
        stored += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:
            stored += sum(v.numel() * v.element_size() for v in state.as_dict(packed=False).values()
                          if torch.is_tensor(v))
        if getattr(p, "SCB", None) is not None:
            stored += p.SCB.numel() * p.SCB.element_size()
    predicted = Layout(quantization=quantization, double_quant=double_quant).base_bytes(count_parameters(CONFIG), 2)
    assert predicted["total"] == stored
    report = preflight(CONFIG, grpo_config=dict(num_generations=2, per_device_train_batch_size=2), warn=False,
                       quantization=quantization, double_quant=double_quant, prompt_length=8)
    assert report.ranks[0].components["weights"] == stored
