"""A compact DeepSeekMath-style GRPO trainer (Shao et al. 2024, "DeepSeekMath", section 4.1), unpatched.

The algorithm in the naive single-process style the kit's article starts from, for readers and as
the baseline the kit's patches are measured against:

* each prompt is sampled ``num_generations`` (G) times with ``model.generate`` in the model's
  training mode (as TRL samples), one batch per step;
* outcome supervision: every token of completion i gets ``A_i = (r_i - mean(r)) / (std(r) + eps)``
  over its own group of G;
* the clipped surrogate ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` per token, minus
  ``beta`` times the k3 estimate of KL(policy || reference), ``exp(ref - logp) - (ref - logp) - 1``,
  averaged over each completion's tokens and then over the G x prompts completions (the paper's
  1/G sum_i 1/|o_i| sum_t);
* ``num_iterations`` (the paper's mu) optimizer steps per batch; the old log-probs are computed once,
  before the first (with mu = 1 they equal the current ones, detached).

With a PEFT model and no ``ref_model``, the reference is the base model (the adapter disabled), as
TRL does for LoRA. Log-probs are of ``logits / temperature``: the distribution that was sampled.
The model's one ``generate`` call is :meth:`DSMGRPOTrainer.sample`, which
``grpo_patches.apply(fast_generation=...)`` wraps (``grpo_patches.targets.dsm``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DSMGRPOConfig", "DSMGRPOTrainer", "group_advantages", "grpo_loss"]


@dataclass
class DSMGRPOConfig:
    num_generations: int = 4  # G
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.04  # KL coefficient (the paper's 0.04)
    epsilon: float = 0.2  # clip range
    num_iterations: int = 1  # mu: optimizer steps per sampled batch
    learning_rate: float = 1e-6  # the paper's policy learning rate
    advantage_eps: float = 1e-4

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"DSMGRPOConfig: num_generations={self.num_generations} must be >= 2 "
                             f"(a group of one has no baseline).")
        if self.num_iterations < 1 or self.max_new_tokens < 1:
            raise ValueError("DSMGRPOConfig: num_iterations and max_new_tokens must be >= 1.")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Each reward normalized within its group of ``group_size`` consecutive completions."""
    grouped = rewards.view(-1, group_size)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, *, beta: float, epsilon: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The DeepSeekMath objective (to minimize) over per-token log-probs ``(batch, tokens)``."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and beta:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token = per_token + beta * kl
    lengths = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / lengths).mean()
    clipped = ((ratio - 1).abs() > epsilon).float()
    stats = {"kl": float(((kl * mask).sum(1) / lengths).mean()),
             "clip_ratio": float((clipped * mask).sum() / mask.sum().clamp(min=1))}
    return loss, stats


class DSMGRPOTrainer:
    """GRPO on a causal LM, one process, one batch of ``len(prompts) * G`` completions per step."""

    def __init__(self, model: nn.Module, tokenizer: Any, reward_fn: Callable[..., Sequence[float]],
                 config: DSMGRPOConfig | None = None, *, ref_model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        from transformers import GenerationConfig

        self.model, self.tokenizer, self.reward_fn = model, tokenizer, reward_fn
        self.config = config = config or DSMGRPOConfig()
        self.ref_model = ref_model
        if ref_model is None and config.beta and not hasattr(model, "disable_adapter"):
            self.ref_model = copy.deepcopy(model).requires_grad_(False).eval()
        self.optimizer = optimizer or torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
        self.generation_config = GenerationConfig(
            max_new_tokens=config.max_new_tokens, do_sample=True, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id)
        self.model.train()

    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Prompt + completion ids from ``model.generate`` (the one call fast generation replaces)."""
        with torch.no_grad():
            return self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                       generation_config=self.generation_config)

    def completion_mask(self, completions: torch.Tensor) -> torch.Tensor:
        """1 up to and including each row's first EOS, 0 after it (and for padding)."""
        is_eos = completions == self.tokenizer.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1])
        return (torch.arange(completions.shape[1], device=completions.device)[None, :] <= first[:, None]).long()

    def token_logprobs(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        """Log-probs of the last ``n`` tokens of ``ids`` under ``model`` (temperature applied)."""
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1].float()
        logp = F.log_softmax(logits / self.config.temperature, dim=-1)
        return logp.gather(-1, ids[:, -n:].unsqueeze(-1)).squeeze(-1)

    def reference_logprobs(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            if self.ref_model is not None:
                return self.token_logprobs(self.ref_model, ids, mask, n)
            with self.model.disable_adapter():
                return self.token_logprobs(self.model, ids, mask, n)

    def step(self, prompts: Sequence[str], **reward_kwargs: Any) -> dict[str, float]:
        """Sample G completions per prompt, score, normalize per group, and optimize ``mu`` times."""
        cfg, G = self.config, self.config.num_generations
        device = next(self.model.parameters()).device
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
        prompt_ids = enc["input_ids"].to(device).repeat_interleave(G, 0)
        prompt_mask = enc["attention_mask"].to(device).repeat_interleave(G, 0)
        sequences = self.sample(prompt_ids, prompt_mask)
        completions = sequences[:, prompt_ids.shape[1]:]
        comp_mask = self.completion_mask(completions)
        texts = self.tokenizer.batch_decode(completions.masked_fill(comp_mask == 0, self.tokenizer.pad_token_id),
                                            skip_special_tokens=True)
        rewards = torch.tensor(
            self.reward_fn(prompts=[p for p in prompts for _ in range(G)], completions=texts,
                           **{k: [v for v in vs for _ in range(G)] for k, vs in reward_kwargs.items()}),
            dtype=torch.float32, device=device)
        advantages = group_advantages(rewards, G, cfg.advantage_eps)
        mask = torch.cat([prompt_mask, comp_mask], 1)
        n = completions.shape[1]
        ref = self.reference_logprobs(sequences, mask, n) if cfg.beta else None
        old = None
        if cfg.num_iterations > 1:
            with torch.no_grad():
                old = self.token_logprobs(self.model, sequences, mask, n)
        for _ in range(cfg.num_iterations):
            logp = self.token_logprobs(self.model, sequences, mask, n)
            loss, stats = grpo_loss(logp, logp.detach() if old is None else old, ref, advantages,
                                    comp_mask.float(), beta=cfg.beta, epsilon=cfg.epsilon)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return {"loss": float(loss), "reward_mean": float(rewards.mean()),
                "reward_std_in_group": float(rewards.view(-1, G).std(1).mean()),
                "completion_length": float(comp_mask.sum(1).float().mean()), **stats}

    def train(self, prompts: Sequence[str], *, steps: int, prompts_per_step: int,
              on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """``steps`` steps over ``prompts`` in order, cycling; returns each step's metrics."""
        history = []
        for i in range(steps):
            start = (i * prompts_per_step) % len(prompts)
            batch = [prompts[(start + j) % len(prompts)] for j in range(prompts_per_step)]
            history.append(self.step(batch))
            if on_step is not None:
                on_step(i, history[-1])
        return history
