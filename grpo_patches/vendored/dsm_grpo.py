"""A compact DeepSeekMath-style GRPO trainer (Shao et al. 2024, "DeepSeekMath", section 4.1), unpatched.

The paper's algorithm, made multi-process with ``accelerate`` the naive way the kit's article
starts from ("the official DeepSeekMath code plus accelerate"). It is the baseline the kit's
patches are measured against, so its faults are kept on purpose and marked ``NAIVE:`` where they
are. Top to bottom, one step:

1. :meth:`DSMGRPOTrainer.create_groups` deals this step's completions to the ranks: every prompt
   repeated G (``num_generations``) times, the stream cut into equal per-rank slices. NAIVE: the
   cut ignores group boundaries, so a group of G straddles two ranks whenever the per-rank batch is
   not a multiple of G, and each epoch's last partial batch is dropped.
2. :meth:`sample`: each rank samples its completions with ``model.generate`` in training mode (as
   TRL samples).
3. :meth:`compute_rewards` ``(responses, prompts)``: each rank scores its own completions with every
   reward function and reward model (an ``nn.Module`` sequence classifier). NAIVE: every reward
   model is moved to every rank's device and run there; an error on one rank is raised on that rank
   only; a wrong-length or NaN reward is not checked.
4. :meth:`group_normalize`: outcome supervision. The rewards of all ranks are all-gathered and
   every token of completion i gets ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over its group of
   G; each rank keeps its own rows. NAIVE: a peer that failed in step 3 leaves this collective
   hanging, or dying with "Connection closed by peer".
5. :meth:`optimize`: the clipped surrogate ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``
   per token, minus ``beta`` times the k3 estimate of KL(policy || reference),
   ``exp(ref - logp) - (ref - logp) - 1``, averaged over each completion's tokens and then over the
   completions (the paper's 1/G sum_i 1/|o_i| sum_t); ``num_iterations`` (the paper's mu) optimizer
   steps per batch, the old log-probs computed once before the first (with mu = 1 they equal the
   current ones, detached). Gradients are averaged over ranks by DDP (``accelerator.prepare``).

With a PEFT model and no ``ref_model`` the reference is the base model (the adapter disabled), as
TRL does for LoRA. Log-probs are of ``logits / temperature``: the distribution that was sampled. In
one process it is the plain single-process trainer (``accelerate`` then wraps nothing).

``grpo_patches.apply()`` replaces :meth:`create_groups` and :meth:`compute_rewards` (and routes
:meth:`sample` through fast generation when asked): see ``grpo_patches.targets.dsm``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DSMGRPOConfig", "DSMGRPOTrainer", "Rollout", "group_advantages", "grpo_loss"]


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
    per_device_batch_size: int = 8  # completions each rank generates per step in train()
    seed: int = 0  # the order in which train() visits the dataset

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"DSMGRPOConfig: num_generations={self.num_generations} must be >= 2 "
                             f"(a group of one has no baseline).")
        if self.num_iterations < 1 or self.max_new_tokens < 1 or self.per_device_batch_size < 1:
            raise ValueError("DSMGRPOConfig: num_iterations, max_new_tokens and per_device_batch_size must be >= 1.")


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


@dataclass
class Rollout:
    """One rank's sampled, scored and normalized completions of one step."""

    sequences: torch.Tensor  # prompt + completion ids, (n, prompt + new tokens)
    prompt_mask: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    rewards: torch.Tensor  # this rank's rewards, (n,)
    all_rewards: torch.Tensor  # every rank's, in rank order, (world * n,)
    advantages: torch.Tensor  # this rank's, (n,)


class DSMGRPOTrainer:
    """GRPO on a causal LM over ``accelerate``'s processes (one process works too).

    ``reward_funcs``: a reward function ``f(prompts=, completions=, **columns) -> list[float]``, a
    reward model (``nn.Module`` whose ``logits[:, 0]`` scores prompt + completion), or a list of
    them; their rewards are summed. ``reward_tokenizers`` (one per entry; default the policy's
    tokenizer) tokenize for the reward models.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, reward_funcs: Any,
                 config: DSMGRPOConfig | None = None, *, ref_model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, accelerator: Any = None,
                 reward_tokenizers: Sequence[Any] | None = None) -> None:
        from accelerate import Accelerator
        from transformers import GenerationConfig

        self.accelerator = accelerator = accelerator or Accelerator()
        self.tokenizer = tokenizer
        self.config = config = config or DSMGRPOConfig()
        funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        if not funcs or any(f is None for f in funcs):
            # with none, every reward, advantage and loss is 0: a run that learns nothing, silently
            raise ValueError(f"DSMGRPOTrainer: reward_funcs={reward_funcs!r}; give at least one reward function "
                             f"or reward model (a list of them is summed).")
        self.reward_funcs = funcs
        self.reward_func_names = self.reward_names(funcs)
        self.reward_tokenizers = list(reward_tokenizers or [tokenizer] * len(funcs))
        for func in funcs:
            if isinstance(func, nn.Module):
                # NAIVE: every rank holds and runs its own copy of every reward model (the opposite
                # extreme, all of them on one extra GPU, leaves that GPU idle most of the step). Never
                # prepared for training, at least: it is only ever run under inference_mode.
                func.to(accelerator.device).eval().requires_grad_(False)
        self.ref_model = ref_model
        if ref_model is None and config.beta and not hasattr(model, "disable_adapter"):
            self.ref_model = copy.deepcopy(model).requires_grad_(False).eval()
        if self.ref_model is not None:
            self.ref_model.to(accelerator.device)
        optimizer = optimizer or torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
        # Only the policy (and its optimizer) is prepared: DDP over the ranks, on this rank's device.
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.generation_config = GenerationConfig(
            max_new_tokens=config.max_new_tokens, do_sample=True, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id)
        self.model.train()

    @staticmethod
    def reward_names(reward_funcs: Any) -> list[str]:
        """A model's name (its config's ``_name_or_path``, last part) or a function's ``__name__``."""
        funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        return [(getattr(getattr(f, "config", None), "_name_or_path", "") or type(f).__name__).split("/")[-1]
                if isinstance(f, nn.Module) else getattr(f, "__name__", type(f).__name__) for f in funcs]

    @property
    def policy(self) -> nn.Module:
        """The policy itself, without the DDP wrapper (for generate, disable_adapter, no-grad passes)."""
        return self.accelerator.unwrap_model(self.model)

    # 1. Groups --------------------------------------------------------------------------------

    def create_groups(self, dataset_size: int) -> Iterator[list[int]]:
        """Step after step, the dataset rows of this rank's completions (one entry per completion).

        Every step takes ``per_device_batch_size * world_size / G`` prompts of a seeded shuffle of
        the dataset (a fresh shuffle per epoch), repeats each G times in a row, and deals the
        stream to the ranks in equal consecutive slices (the layout of TRL's ``RepeatSampler``).
        """
        cfg, G = self.config, self.config.num_generations
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        b = cfg.per_device_batch_size
        if (b * world) % G:
            raise ValueError(f"DSMGRPOTrainer: per_device_batch_size={b} x {world} processes is not a multiple of "
                             f"num_generations={G}.")
        prompts_per_step = b * world // G
        if dataset_size < prompts_per_step:
            raise ValueError(f"DSMGRPOTrainer: a step takes {prompts_per_step} prompts; the dataset has {dataset_size}.")
        generator = torch.Generator().manual_seed(cfg.seed)
        while True:
            order = torch.randperm(dataset_size, generator=generator).tolist()
            # NAIVE: the epoch's last partial batch of prompts is dropped (a different set each epoch).
            for start in range(0, dataset_size - prompts_per_step + 1, prompts_per_step):
                stream = [row for row in order[start:start + prompts_per_step] for _ in range(G)]
                # NAIVE: the only check above is on the global batch (as TRL's): this cut ignores
                # group boundaries, so with b % G != 0 a group is generated and scored half on one
                # rank and half on the next.
                yield stream[rank * b:(rank + 1) * b]

    # 2. Sampling ------------------------------------------------------------------------------

    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Prompt + completion ids from ``model.generate`` (the one call fast generation replaces)."""
        with torch.no_grad():
            return self.policy.generate(input_ids=input_ids, attention_mask=attention_mask,
                                        generation_config=self.generation_config)

    def completion_mask(self, completions: torch.Tensor) -> torch.Tensor:
        """1 up to and including each row's first EOS, 0 after it (and for padding)."""
        is_eos = completions == self.tokenizer.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1])
        return (torch.arange(completions.shape[1], device=completions.device)[None, :] <= first[:, None]).long()

    # 3. Rewards -------------------------------------------------------------------------------

    def score_with_model(self, model: nn.Module, tokenizer: Any, prompts: Sequence[str],
                         responses: Sequence[str]) -> torch.Tensor:
        """A sequence classifier's score of each prompt + completion (its logit 0)."""
        inputs = tokenizer([p + r for p, r in zip(prompts, responses, strict=True)], return_tensors="pt",
                           padding=True, padding_side="right", add_special_tokens=False)
        device = next(model.parameters()).device
        with torch.inference_mode():
            return model(**{k: v.to(device) for k, v in inputs.items()}).logits[:, 0].float().cpu()

    def compute_rewards(self, responses: Sequence[str], prompts: Sequence[str], **columns: Any) -> torch.Tensor:
        """The summed reward of each of this rank's completions, ``(n,)`` on this rank's device."""
        rewards = torch.zeros(len(responses), len(self.reward_funcs))
        for i, (func, tokenizer) in enumerate(zip(self.reward_funcs, self.reward_tokenizers, strict=True)):
            if isinstance(func, nn.Module):
                # NAIVE: scored here, on every rank, by that rank's copy of the model.
                rewards[:, i] = self.score_with_model(func, tokenizer, prompts, responses)
            else:
                # NAIVE: the function sees this rank's share only (a split group arrives in two
                # pieces, on two ranks); an exception stays on this rank; the length and the
                # values are not checked (a NaN poisons its group's mean and std).
                rewards[:, i] = torch.tensor(func(prompts=list(prompts), completions=list(responses), **columns),
                                             dtype=torch.float32)
        return rewards.sum(1).to(self.accelerator.device)

    def group_normalize(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' rewards (rank order) and this rank's advantages, normalized per group of G."""
        # NAIVE: a collective every step (needed only because groups may straddle ranks); a rank
        # that failed before it leaves the others waiting here, or dying with an unrelated error.
        all_rewards = self.accelerator.gather(rewards)
        advantages = group_advantages(all_rewards, self.config.num_generations, self.config.advantage_eps)
        n, rank = rewards.shape[0], self.accelerator.process_index
        return all_rewards, advantages[rank * n:(rank + 1) * n]

    # 4. One step ------------------------------------------------------------------------------

    def rollout(self, prompts: Sequence[str], **columns: Sequence[Any]) -> Rollout:
        """Sample one completion per entry of ``prompts`` (a prompt repeated G times makes a group),
        score them, and normalize the rewards per group. ``columns``: per-entry values given to the
        reward functions by name (e.g. a reference answer)."""
        device = self.accelerator.device
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
        prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        sequences = self.sample(prompt_ids, prompt_mask)
        completions = sequences[:, prompt_ids.shape[1]:]
        comp_mask = self.completion_mask(completions)
        texts = self.tokenizer.batch_decode(completions.masked_fill(comp_mask == 0, self.tokenizer.pad_token_id),
                                            skip_special_tokens=True)
        rewards = self.compute_rewards(texts, list(prompts), **{k: list(v) for k, v in columns.items()})
        all_rewards, advantages = self.group_normalize(rewards)
        return Rollout(sequences, prompt_mask, comp_mask, texts, rewards, all_rewards, advantages)

    def token_logprobs(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        """Log-probs of the last ``n`` tokens of ``ids`` under ``model`` (temperature applied)."""
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1].float()
        logp = F.log_softmax(logits / self.config.temperature, dim=-1)
        return logp.gather(-1, ids[:, -n:].unsqueeze(-1)).squeeze(-1)

    def reference_logprobs(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            if self.ref_model is not None:
                return self.token_logprobs(self.ref_model, ids, mask, n)
            with self.policy.disable_adapter():
                return self.token_logprobs(self.policy, ids, mask, n)

    def optimize(self, rollout: Rollout) -> dict[str, float]:
        """``num_iterations`` optimizer steps on the clipped objective with the k3 KL penalty."""
        cfg = self.config
        ids, comp_mask = rollout.sequences, rollout.completion_mask
        mask = torch.cat([rollout.prompt_mask, comp_mask], 1)
        n = comp_mask.shape[1]
        ref = self.reference_logprobs(ids, mask, n) if cfg.beta else None
        old = None
        if cfg.num_iterations > 1:
            with torch.no_grad():
                old = self.token_logprobs(self.policy, ids, mask, n)
        for _ in range(cfg.num_iterations):
            logp = self.token_logprobs(self.model, ids, mask, n)  # through DDP: gradients averaged over ranks
            loss, stats = grpo_loss(logp, logp.detach() if old is None else old, ref, rollout.advantages,
                                    comp_mask.float(), beta=cfg.beta, epsilon=cfg.epsilon)
            self.optimizer.zero_grad(set_to_none=True)
            self.accelerator.backward(loss)
            self.optimizer.step()
        G = cfg.num_generations
        return {"loss": float(loss), "reward_mean": float(rollout.all_rewards.mean()),
                "reward_std_in_group": float(rollout.all_rewards.view(-1, G).std(1).mean()),
                "completion_length": float(comp_mask.sum(1).float().mean()), **stats}

    def step(self, prompts: Sequence[str], **reward_kwargs: Sequence[Any]) -> dict[str, float]:
        """One step on ``prompts`` (this rank's): each sampled G times, scored, normalized, optimized."""
        G = self.config.num_generations
        rollout = self.rollout([p for p in prompts for _ in range(G)],
                               **{k: [v for v in vs for _ in range(G)] for k, vs in reward_kwargs.items()})
        return self.optimize(rollout)

    def train(self, dataset: Sequence[str | Mapping[str, Any]], *, steps: int,
              on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """``steps`` steps over ``dataset`` (prompts, or rows with a ``"prompt"`` and other columns
        for the reward functions), in the order :meth:`create_groups` deals; each step's metrics."""
        rows = [{"prompt": r} if isinstance(r, str) else dict(r) for r in dataset]
        groups = self.create_groups(len(rows))
        history = []
        for i in range(steps):
            mine = [rows[j] for j in next(groups)]
            columns = {k: [r[k] for r in mine] for k in mine[0] if k != "prompt"}
            history.append(self.optimize(self.rollout([r["prompt"] for r in mine], **columns)))
            if on_step is not None:
                on_step(i, history[-1])
        return history
