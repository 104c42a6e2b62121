"""A reward model: a sequence classifier with one logit, trained on preference pairs with the
Bradley–Terry loss (:class:`RewardTrainer`), then used to score completions
(:class:`RewardModelScorer`, a GRPO reward function).

The model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` loaded from the causal LM
the stage starts from (its score head fresh, the rest of its weights shared). transformers reads the
logit at each sequence's last token that is not padding (``config.pad_token_id``); the sequences
are the prompt and the completion as the data preparation tokenizes them (the completion's EOS
included), so training and scoring read the same position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)

from trainers.collators import sequence_batch
from trainers.data import render_completion, render_prompt
from trainers.devices import torch_dtype
from trainers.metric_window import MetricWindow
from trainers.modeling import load_tokenizer
from trainers.reward_section import RewardStageConfig
from trainers.sections import section_fields


def bradley_terry_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """The Bradley–Terry reward-model loss per pair (Ouyang et al. 2022, arXiv:2203.02155, eq. 1;
    the margin of Touvron et al. 2023, arXiv:2307.09288, eq. 2; the centring term of Eisenstein et
    al. 2023, arXiv:2312.09244), for rewards ``r_c``, ``r_r`` of the chosen and rejected sequences:

        L = −log σ(r_c − r_r − m) + c (r_c + r_r)²

    ``m`` is the pair's margin (0 without one), ``c`` the centring coefficient (none: 0). The
    centring term's batch mean is TRL's ``center_rewards_coefficient · mean((r_c + r_r)²)``."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def load_reward_model(
    path: str, revision: str | None = None, dtype: str = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A one-logit sequence classifier from ``path`` (a causal LM: a fresh score head; a saved
    reward model: its own), with the tokenizer's padding token in its config."""
    tokenizer = load_tokenizer(path, revision)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, revision=revision, num_labels=1, dtype=torch_dtype(dtype)
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@dataclass
class PairSequenceCollator:
    """``2B`` sequences, the ``B`` prompt + chosen then the ``B`` prompt + rejected, padded right;
    ``margin`` when the pairs have one."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [f["prompt_ids"] + f["chosen_ids"] for f in features]
        sequences += [f["prompt_ids"] + f["rejected_ids"] for f in features]
        batch = sequence_batch(sequences, self.pad_token_id)
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([float(f["margin"]) for f in features])
        return batch


@dataclass
@section_fields(RewardStageConfig)
class RewardConfig(TrainingArguments):
    """``TrainingArguments`` plus the reward section's fields, with its defaults."""

    remove_unused_columns: bool = False  # the collator reads prompt_ids / chosen_ids / rejected_ids


class RewardTrainer(MetricWindow, Trainer):
    """Trains a one-logit sequence classifier on preference pairs with :func:`bradley_terry_losses`;
    logs the pairs' ``accuracy`` (r_c > r_r), mean ``margin`` and rewards, ``eval_``-prefixed on the
    held-out pairs."""

    loss_is_scaled_for_ga = False  # compute_loss returns a per-micro-batch mean

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rewards = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, 0]
        chosen, rejected = rewards.float().chunk(2)
        losses = bradley_terry_losses(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient)
        loss = losses.mean()
        difference = (chosen - rejected).detach()
        metrics = {
            "accuracy": (difference > 0).float().mean(),
            "margin": difference.mean(),
            "rewards/chosen": chosen.detach().mean(),
            "rewards/rejected": rejected.detach().mean(),
        }
        self.record_metrics(metrics, "train" if model.training else "eval")
        return (loss, {"rewards": rewards}) if return_outputs else loss


class RewardModelScorer:
    """A reward model as a GRPO reward function (TRL's contract, :mod:`trainers.rewards`): each
    prompt and completion, as the data has them, tokenized as the data preparation tokenizes a pair
    (:func:`~trainers.data.render_prompt`, :func:`~trainers.data.render_completion`), scored in
    batches of ``batch_size`` without gradient. :meth:`to` puts the model on a device (the policy's)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, batch_size: int = 64):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.__name__ = name
        self.batch_size = batch_size

    def to(self, device: torch.device | str) -> RewardModelScorer:
        self.model.to(device)
        return self

    @torch.no_grad()
    def __call__(self, *, prompts: list, completions: list, **kwargs) -> list[float]:
        sequences = [
            render_prompt(self.tokenizer, prompt) + render_completion(self.tokenizer, completion, prompt)
            for prompt, completion in zip(prompts, completions)
        ]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            batch = sequence_batch(sequences[start : start + self.batch_size], self.tokenizer.pad_token_id)
            scores += self.model(**{k: v.to(device) for k, v in batch.items()}).logits[:, 0].float().tolist()
        return scores
