"""How the policy is put for sampling (eval mode, checkpointing hooks hidden), prompt padding and the
sampled-log-prob recorder: small pieces with no compile or cache state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .config import round_up

__all__ = ["SampledLogprobs", "hidden_require_grad_hooks", "left_pad", "sampling_mode"]


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



def left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, multiple: int, *,
             pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad a batch to a multiple of ``multiple`` (pads get attention mask 0)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    extra = round_up(input_ids.shape[1], multiple) - input_ids.shape[1]
    if extra == 0:
        return input_ids, attention_mask
    pad_ids = input_ids.new_full((input_ids.shape[0], extra), pad_token_id)
    pad_mask = attention_mask.new_zeros((attention_mask.shape[0], extra))
    return torch.cat([pad_ids, input_ids], dim=1), torch.cat([pad_mask, attention_mask], dim=1)
