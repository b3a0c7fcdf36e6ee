"""The kit's reward loop on the watchdog thread, for the device a single-process run reports.

Found on an H200: ``accelerate launch --num_processes 1`` gives ``accelerator.device ==
torch.device("cuda")`` (no index), and ``torch.cuda.set_device`` refuses an index-less device, so
every patched 1-GPU run failed at its first reward. The refusal happens before CUDA is touched,
so it shows on CPU too.
"""

from __future__ import annotations

import types

import pytest
import torch

from grpo_patches.collectives import call_with_timeout
from grpo_patches.rewards import RewardBatch
from grpo_patches.targets.trl_glue import score_batch


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def stub_trainer(device: torch.device):
    return types.SimpleNamespace(accelerator=types.SimpleNamespace(device=device), reward_funcs=[length_reward],
                                 reward_processing_classes=[None], reward_func_names=["length_reward"], state=None)


def test_set_device_refuses_an_index_less_cuda_device():
    """The upstream condition: what a naive set_device in the worker thread would hit."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


def test_single_process_cuda_device_scores_on_the_watchdog_thread():
    batch = RewardBatch(["p", "p"], ["ab", "abcd"], [[1, 2], [1, 2, 3, 4]])
    scored = call_with_timeout(
        lambda: score_batch(stub_trainer(torch.device("cuda")), batch, [0, 0], num_generations=2,
                            with_environments=False),
        timeout=30, what="test rewards")
    assert scored.rewards[:, 0].tolist() == [2.0, 4.0]
