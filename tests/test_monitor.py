"""GRPOMonitorCallback: a real GRPOTrainer run on CPU, the report_to path, thresholds, NVML absent."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
from transformers import TrainerCallback

from grpo_patches import monitor as mon
from grpo_patches.defaults import apply_lora, grpo_config
from grpo_patches.monitor import GRPOMonitorCallback, MonitorWarning, in_group_reward_std
from tests.helpers import prompt_dataset, quiet, tiny_policy, tiny_tokenizer

GiB = 2**30


class Recorder(TrainerCallback):
    """Stands where transformers puts the report_to integrations: right after DefaultFlowCallback."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def two_groups_per_batch(completions, **kwargs):
    """Rewards (0, 1), (10, 11), ...: every group's std is sqrt(0.5); the batch's std is much larger."""
    return [float(i % 2) + 10.0 * (i // 2) for i in range(len(completions))]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import trl

    quiet()
    args = grpo_config(
        str(tmp_path_factory.mktemp("monitor")), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=1, max_completion_length=6,
        max_steps=2, logging_steps=1, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0,
    )
    model = apply_lora(tiny_policy(), args=args)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=two_groups_per_batch, args=args,
                              train_dataset=prompt_dataset(16), processing_class=tiny_tokenizer())
    recorder = Recorder()
    trainer.callback_handler.callbacks.insert(1, recorder)
    monitor = GRPOMonitorCallback(grad_norm_threshold=0.0, reward_std_threshold=0.1,
                                  reward_std_after_step=2).attach(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return types.SimpleNamespace(trainer=trainer, recorder=recorder, monitor=monitor,
                                 warnings=[w for w in caught if issubclass(w.category, MonitorWarning)])


def step_logs(logs):
    return [entry for entry in logs if "loss" in entry]


def test_attach_puts_the_monitor_ahead_of_the_loggers(run):
    assert run.trainer.callback_handler.callbacks[0] is run.monitor


def test_metrics_reach_the_report_to_slot_and_log_history(run):
    for logs in (step_logs(run.recorder.logs), step_logs(run.trainer.state.log_history)):
        assert len(logs) == 2
        for entry in logs:
            assert entry["monitor/rank0/cpu_rss_gb"] > 0
            assert entry["monitor/rank0/cpu_peak_rss_gb"] >= entry["monitor/rank0/cpu_rss_gb"] * 0.5
            assert "monitor/rank0/gpu_utilization" not in entry  # no NVML on CPU: skipped, not faked
            assert "monitor/rank0/memory_free_gb" not in entry


def test_in_group_reward_std_is_within_groups_not_over_the_batch(run):
    for entry in step_logs(run.recorder.logs):
        assert entry["monitor/reward_group_std"] == pytest.approx(math.sqrt(0.5))
        assert entry["monitor/reward_group_std_max"] == pytest.approx(math.sqrt(0.5))
        assert entry["reward_std"] > 5  # TRL's figure: the std over the whole batch


def test_thresholds_fire_during_a_real_run(run):
    messages = [str(w.message) for w in run.warnings]
    assert sum("gradient norm" in m for m in messages) == 2  # threshold 0: every logged step
    assert sum("in-group reward std" in m for m in messages) == 1  # only from step 2 on


# ----------------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(("values", "step", "fires"), [
    ({"memory_free_gb": 1.9}, 1, True), ({"memory_free_gb": 2.1}, 1, False),
    ({"reward_group_std": 0.6}, 999, False), ({"reward_group_std": 0.6}, 1000, True),
    ({"reward_group_std": 0.4}, 5000, False), ({"reward_group_std": float("nan")}, 5000, False),
    ({"grad_norm": 10.5}, 3, True), ({"grad_norm": 9.9}, 3, False), ({}, 3, False),
])
def test_health_thresholds(values, step, fires):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages = GRPOMonitorCallback().check(values, step=step)
    assert bool(messages) is fires
    assert len([w for w in caught if issubclass(w.category, MonitorWarning)]) == len(messages)


def test_in_group_reward_std_matches_bessel_and_skips_nans():
    rewards = torch.tensor([0.0, 1.0, 10.0, 12.0, 5.0, float("nan"), 7.0])  # the trailing 7.0 is a partial group
    stds = in_group_reward_std(rewards, 2)
    assert stds[0].item() == pytest.approx(math.sqrt(0.5))
    assert stds[1].item() == pytest.approx(math.sqrt(2.0))
    assert math.isnan(stds[2].item()) and len(stds) == 3


# ------------------------------------------------------------------------------- CUDA / NVML paths


def fake_cuda(monkeypatch, utilization):
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (int(1.5 * GiB), 24 * GiB))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 20 * GiB)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 22 * GiB)
    monkeypatch.setattr(cuda, "utilization", utilization)


def test_gpu_metrics_and_missing_nvml_is_skipped(monkeypatch):
    def no_nvml(device=None):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    fake_cuda(monkeypatch, no_nvml)
    callback = GRPOMonitorCallback()
    assert callback.local_metrics() == {"memory_allocated_gb": 20.0, "memory_peak_gb": 22.0, "memory_free_gb": 1.5}
    fake_cuda(monkeypatch, lambda device=None: 91)
    assert GRPOMonitorCallback().local_metrics()["gpu_utilization"] == 91.0


def test_low_free_memory_warns_through_on_log(monkeypatch):
    fake_cuda(monkeypatch, lambda device=None: 50)
    callback = GRPOMonitorCallback()
    state = types.SimpleNamespace(global_step=3, is_world_process_zero=True, log_history=[{"loss": 1.0, "step": 3}])
    callback.on_step_end(None, state, None)
    logs = {"loss": 1.0, "grad_norm": 0.5}
    with pytest.warns(MonitorWarning, match="1.50 GiB free"):
        callback.on_log(None, state, None, logs=logs)
    assert logs["monitor/rank0/memory_free_gb"] == 1.5 and logs["monitor/rank0/gpu_utilization"] == 50.0
    assert state.log_history[-1]["monitor/rank0/memory_peak_gb"] == 22.0


def test_without_a_trainer_reward_std_is_skipped():
    callback = GRPOMonitorCallback()
    assert callback.reward_group_std() is None
    state = types.SimpleNamespace(global_step=1, is_world_process_zero=True, log_history=[])
    logs: dict = {}
    callback.on_log(None, state, None, logs=logs)
    assert not any("reward_group_std" in k for k in logs) and any(k.startswith("monitor/rank0/") for k in logs)


def test_rss_helpers_report_bytes():
    assert mon._rss_bytes() is None or mon._rss_bytes() > 10 * 2**20
    assert mon._peak_rss_bytes() > 10 * 2**20


# ------------------------------------------------------------------------------------ two ranks


@pytest.mark.distributed
def test_each_rank_figures_reach_rank_zero_logs():
    from tests.launch import describe, run_ranks

    results = run_ranks("tests.test_monitor", world_size=2, deadline=120)
    assert all(r.returncode == 0 for r in results), describe(results)
    for r in results:  # every rank's logs carry every rank's figures; rank 0's are what report_to writes
        assert {"monitor/rank0/cpu_rss_gb", "monitor/rank1/cpu_rss_gb"} <= set(r.data["keys"]), describe(results)
    assert len(set(results[0].data["pids"])) == 2  # two real processes


def _rank_worker(outdir: str) -> int:
    """One rank of the test above: the callback's step-end gather and its log, over gloo."""
    import json
    import os
    from pathlib import Path

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    callback = GRPOMonitorCallback()
    state = types.SimpleNamespace(global_step=1, is_world_process_zero=rank == 0, log_history=[])
    callback.on_step_end(None, state, None)
    logs: dict = {"loss": 0.0}
    callback.on_log(None, state, None, logs=logs)
    pids: list = [None, None]
    torch.distributed.all_gather_object(pids, os.getpid())
    Path(outdir, f"rank{rank}.json").write_text(json.dumps({"keys": sorted(logs), "pids": pids}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    import os
    import sys

    sys.stdout.flush()
    os._exit(_rank_worker(sys.argv[1]))  # gloo at interpreter exit can hang or abort otherwise
