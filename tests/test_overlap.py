"""``grpo_patches.overlap``: no host read of a device value between a micro-batch's backward and the
next micro-batch's forward.

Stock transformers reads each micro-batch's loss on the host (``torch.isnan(loss) or torch.isinf(loss)``) and, in
the training forward's SDPA mask, the padding mask (``padding_mask.all()``): on a GPU each is a wait for the
device. With ``apply(overlap_micro_batches=True)`` (``enable_overlap``) neither is read and every logged loss is the
same number."""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_patches
from grpo_patches import overlap as overlap_module
from grpo_patches.overlap import (
    FilteredLoss,
    enable_overlap,
    filtered,
    mark_unpadded,
    mask_unread,
    take_unpadded,
)
from tests.helpers import grpo_args, patched_trl_trainer

transformers = pytest.importorskip("transformers")
# The module's own detection: transformers decides the SDPA mask skip in ``masking_utils`` (the mask piece) ...
_MASK_SKIP_HERE = overlap_module._masking_utils() is not None

BAD = {2: float("nan"), 4: float("inf"), 5: float("-inf")}  # 1-based micro-batches whose loss is not finite


@pytest.fixture(autouse=True)
def clean():
    grpo_patches.revert()
    yield
    grpo_patches.revert()


class HostReads(TorchDispatchMode):
    """Counts host reads (``_local_scalar_dense``: ``bool()``, ``.item()``) of ``isnan`` / ``isinf`` results
    (``loss``) and, with autograd on, inside transformers' ``masking_utils`` (``mask``)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[torch.Tensor] = []  # kept alive, so their ids stay theirs
        self.loss = self.mask = self.skip_test = 0  # skip_test: the mask's reads inside transformers' skip test

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.isnan.default, torch.ops.aten.isinf.default):
            self.checked.append(out)
        elif func is torch.ops.aten._local_scalar_dense.default:
            if any(args[0] is t for t in self.checked):
                self.loss += 1
            elif torch.is_grad_enabled():
                frames = [f for f in traceback.extract_stack() if "masking_utils" in f.filename]
                self.mask += bool(frames)
                self.skip_test += any(f.name == "_ignore_causal_mask_sdpa" for f in frames)
        return out


def spoiled(trainer):
    """``trainer.compute_loss`` with the micro-batches of ``BAD`` made NaN / inf in value (not in gradient: the
    constant adds nothing to it, so the run goes on alike)."""
    compute, calls = trainer.compute_loss, [0]

    def compute_loss(*args, **kwargs):
        loss = compute(*args, **kwargs)
        calls[0] += 1
        return loss + BAD[calls[0]] if calls[0] in BAD else loss

    trainer.compute_loss = compute_loss
    return trainer


def run(overlap: bool = False, nan_filter: bool = True, answers: list | None = None):
    """Six micro-batches (three steps of two), the losses of ``BAD`` spoiled, the trainer built under ``apply()`` with
    ``overlap_micro_batches=overlap``: (logged losses, host reads). ``answers``: per micro-batch, (the host's
    "nothing padded", the masks' own, whether the key reached the loss)."""
    args = grpo_args(max_steps=3, gradient_accumulation_steps=2, logging_nan_inf_filter=nan_filter)
    trainer = spoiled(patched_trl_trainer(args, overlap_micro_batches=overlap))
    if answers is not None:
        compute = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            answers.append((overlap_module._unread.unpadded, bool(mask.all()), overlap_module._ROWS in inputs))
            return compute(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
    with HostReads() as reads:
        trainer.train()
    reads.running_loss_on_trainer = hasattr(trainer, "_tr_loss")  # ... and keeps its running loss on itself (the loss piece)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], reads


def test_no_host_read_between_micro_batches_and_the_logged_losses_are_stock_s():
    stock, stock_reads = run()
    assert stock_reads.loss >= 6, "stock: isnan / isinf of the loss read on the host for each of the six micro-batches"
    assert stock_reads.mask >= 6, "stock: the padding mask read in each micro-batch's training forward"
    assert all(loss == loss and abs(loss) != float("inf") for loss in stock), "stock filtered the spoiled losses"
    answers: list = []
    losses, reads = run(overlap=True, answers=answers)
    assert losses == stock, "the same logged losses, to the bit"
    assert len(answers) == 6 and all(host == own and not leaked for host, own, leaked in answers), answers
    assert {own for _, own, _ in answers} == {True, False}, "micro-batches with and without padding both ran"
    # each piece where this transformers has its read; elsewhere the read is left as it is
    assert reads.loss == (0 if reads.running_loss_on_trainer else stock_reads.loss), "the loss is not read"
    assert reads.mask == (0 if _MASK_SKIP_HERE else stock_reads.mask), "the padding mask is not read"
    assert _MASK_SKIP_HERE or not stock_reads.skip_test, "stock reads in the skip test the module did not find"


def test_with_the_filter_off_nothing_is_filtered():
    stock, _ = run(nan_filter=False)
    losses, _ = run(overlap=True, nan_filter=False)
    assert stock and stock[0] != stock[0], "step 1 holds the NaN micro-batch: logged as NaN, unfiltered"
    assert [str(loss) for loss in losses] == [str(loss) for loss in stock]


@pytest.mark.skipif(not _MASK_SKIP_HERE, reason="this transformers decides the SDPA mask skip elsewhere")
def test_inside_a_step_the_training_mask_is_built_unread_and_everything_else_is_as_stock():
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa
    assert not hasattr(original, "grpo_patches_original"), "transformers' own function outside a step"
    unpadded = torch.ones(2, 5, dtype=torch.bool)

    def skip(mask):
        return masking_utils._ignore_causal_mask_sdpa(mask, 5, 5, 0, 0, None)

    assert bool(skip(unpadded)), "stock skips the mask of an unpadded batch"
    with mask_unread():
        with HostReads() as reads:
            assert skip(unpadded) is False, "the training forward: built, unread"
        assert reads.mask == 0
        with torch.no_grad():
            assert bool(skip(unpadded)), "sampling and scoring (no autograd): stock's skip"
        with mask_unread():  # nested: still swapped, put back only by the outer one
            assert skip(unpadded) is False
        assert skip(unpadded) is False
    assert masking_utils._ignore_causal_mask_sdpa is original, "the identical function is put back"
    run(overlap=True)
    assert masking_utils._ignore_causal_mask_sdpa is original, "and after a training run"


def fake_trainer(running: torch.Tensor, *, step: int = 3, last_logged: int = 1, nan_filter: bool = True):
    return SimpleNamespace(_tr_loss=running, _globalstep_last_logged=last_logged,
                           state=SimpleNamespace(global_step=step), args=SimpleNamespace(logging_nan_inf_filter=nan_filter))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_loss_becomes_what_the_trainer_adds_in_its_place(bad):
    running = torch.tensor(6.0)
    out = filtered(fake_trainer(running), torch.tensor(bad))
    assert isinstance(out, FilteredLoss)
    assert not (torch.isnan(out) or torch.isinf(out)) and not out.isnan() and not out.isinf()
    stock = running.clone()
    stock += stock / (1 + 3 - 1)  # transformers' replacement: the running loss over one plus the unlogged steps
    running += out
    assert type(running) is torch.Tensor and running.item() == stock.item() == 8.0


def test_a_finite_loss_is_added_as_it_is_and_the_check_reads_nothing():
    running = torch.tensor(6.0)
    out = filtered(fake_trainer(running), torch.tensor(0.25, dtype=torch.bfloat16))
    with HostReads() as reads:
        assert not (torch.isnan(out) or torch.isinf(out))
    assert reads.loss == 0
    running += out
    assert running.item() == 6.25 and running.dtype == torch.float32


@pytest.mark.parametrize("case", ["filter off", "two values", "other device", "no running loss", "not a tensor"])
def test_where_the_filter_does_not_apply_the_loss_is_returned_as_it_is(case):
    running, loss = torch.tensor(6.0), torch.tensor(float("nan"))
    trainer = fake_trainer(running, nan_filter=case != "filter off")
    if case == "two values":
        loss = torch.tensor([1.0, float("nan")])
    elif case == "other device":
        loss = torch.tensor(float("nan"), device="meta")
    elif case == "no running loss":
        del trainer._tr_loss
    elif case == "not a tensor":
        loss = float("nan")
    assert filtered(trainer, loss) is loss


def test_only_inside_train_and_train_s_result_and_errors_pass_through():
    trainer = fake_trainer(torch.tensor(6.0))
    seen = []
    trainer.training_step = lambda *args, **kwargs: torch.tensor(float("nan"))

    def train(fail=False):
        seen.append(trainer.training_step())
        if fail:
            raise RuntimeError("out of memory")
        return "trained"

    trainer.train = train
    enable_overlap(trainer)
    wrapped = trainer.training_step, trainer.train
    enable_overlap(trainer)
    assert (trainer.training_step, trainer.train) == wrapped, "once per trainer"
    assert trainer.train() == "trained" and isinstance(seen[-1], FilteredLoss) and seen[-1].item() == 2.0
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train(fail=True)
    assert isinstance(seen[-1], FilteredLoss)
    outside = trainer.training_step()
    assert type(outside) is torch.Tensor and outside.isnan(), "a direct call outside train() gets the raw loss"


@pytest.mark.skipif(not _MASK_SKIP_HERE, reason="this transformers decides the SDPA mask skip elsewhere")
@pytest.mark.parametrize(("unpadded", "skipped"), [(True, True), (False, False), (None, False)])
def test_the_skip_test_runs_on_the_host_s_answer(unpadded, skipped):
    """Nothing padded: transformers' own skip (flash attention kept); padded or not known: built; never a read."""
    from transformers import masking_utils

    padded = torch.tensor([[True, True, True, True, True], [False, True, True, True, True]])
    with mask_unread():
        overlap_module._unread.unpadded = unpadded
        try:
            with HostReads() as reads:
                got = masking_utils._ignore_causal_mask_sdpa(padded, 5, 5, 0, 0, None)
        finally:
            overlap_module._unread.unpadded = None
    assert bool(got) is skipped and reads.mask == 0


def test_each_micro_batch_carries_its_rows_answer_through_trl_s_shuffle_and_split():
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    prompt_mask = torch.tensor([[1, 1], [0, 1], [1, 1], [1, 1]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    batch = mark_unpadded({"prompt_ids": torch.arange(4)[:, None], "prompt_mask": prompt_mask,
                           "completion_mask": completion_mask})
    assert batch[overlap_module._ROWS].device.type == "cpu"
    assert batch[overlap_module._ROWS].tolist() == [True, False, False, True]
    for micro in split_tensor_dict(shuffle_sequence_dict(batch), 2):
        rows = micro["prompt_ids"][:, 0].tolist()
        taken = take_unpadded(micro)
        assert overlap_module._ROWS not in taken and overlap_module._ROWS in micro, "a copy: TRL reuses the batch"
        assert overlap_module._unread.unpadded is (set(rows) <= {0, 3})
    overlap_module._unread.unpadded = None
