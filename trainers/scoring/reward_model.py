"""A reward model: a scorer of prompt + completion sequences, trained on preference pairs by the
reward stage (:class:`trainers.reward.trainer.RewardTrainer`), then used to score completions
(:class:`RewardModelScorer`: a GRPO reward function, and the evaluation's reward model). Its
*head* (:data:`REWARD_HEADS`) says what the score is:

* ``classifier``: ``AutoModelForSequenceClassification`` with ``num_labels=1`` loaded from the
  causal LM the stage starts from (its score head fresh, the rest of its weights shared).
  transformers reads the logit at each sequence's last token that is not padding
  (``config.pad_token_id``).
* ``likelihood``: the causal LM itself; the score is its mean log-prob of the completion's tokens,
  ``(1/|y|) Σ_t log π(y_t | x, y_<t)``, SimPO's reference-free implicit reward (Meng et al. 2024,
  arXiv:2405.14734) without its β. A small model that already solves the task holds what a fresh
  score head must learn in its next-token distributions.

The sequences are the prompt and the completion as the data preparation tokenizes them (the
completion's EOS included), so training and scoring read the same tokens; a completion sampled up
to a length limit is scored as cut, without EOS or end of turn. A saved reward model's
head is read off its architecture (``…ForSequenceClassification`` or ``…ForCausalLM``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from trainers.data.collators import prompt_completion_batch
from trainers.data.packing import packed_batch
from trainers.data.rows import render_completion, render_prompt
from trainers.models.attention import Packing, packing_for
from trainers.models.devices import torch_dtype
from trainers.models.pretrained import LOAD_OPTIONS, ModelLoader, load_tokenizer, load_with_new_head
from trainers.models.transformers_compat import classifier_parts
from trainers.registry import Registry
from trainers.scoring.logprobs import completion_logps
from trainers.sections import PaddingFree


@dataclass(frozen=True)
class RewardHead:
    """What a reward model is: the transformers class that loads it (``num_labels`` for a
    classifier) and how it scores a batch of ``prompt_completion_batch`` rows, one score per row."""

    auto_class: ModelLoader
    architecture_suffix: str  # of a saved model's ``config.architectures``
    score: Callable[[PreTrainedModel, dict[str, torch.Tensor], Packing | None], torch.Tensor]
    peft_task_type: str  # LoRA adapters for this kind of model (``trainers.models.lora.add_adapters``)
    load_options: tuple[tuple[str, int], ...] = ()

    def matches(self, architectures: list[str]) -> bool:
        """Whether any of ``architectures`` (class names: a saved config's, or a model's own) is one of
        this head's models."""
        return any(architecture.endswith(self.architecture_suffix) for architecture in architectures)


def classifier_scores(
    model: PreTrainedModel, batch: dict[str, torch.Tensor], packing: Packing | None = None
) -> torch.Tensor:
    """The score head's logit at each row's last token; padding-free with ``packing`` (the backbone
    over the packed rows, the head at each row's last slot)."""
    mask = batch["attention_mask"]
    packed = None if packing is None else packed_batch(mask, packing)
    if packed is None:
        return model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]
    backbone, head = classifier_parts(model)
    hidden = backbone(
        input_ids=packed.scatter(batch["input_ids"], mask),
        position_ids=packed.position_ids(mask.device),
        use_cache=False,
    ).last_hidden_state
    rows = torch.arange(mask.shape[0], device=mask.device)
    last = packed.starts + mask.sum(1) - 1
    return head(hidden[packed.locate(rows, last)])[:, 0]


def likelihood_scores(
    model: PreTrainedModel, batch: dict[str, torch.Tensor], packing: Packing | None = None
) -> torch.Tensor:
    logps = completion_logps(
        model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], packing=packing
    )
    return logps.logps / logps.num_tokens


REWARD_HEADS: Registry[RewardHead] = Registry("reward head", "reward.head")
REWARD_HEADS.add(
    "classifier",
    RewardHead(
        AutoModelForSequenceClassification,
        "ForSequenceClassification",
        classifier_scores,
        "SEQ_CLS",
        (("num_labels", 1),),
    ),
)
REWARD_HEADS.add("likelihood", RewardHead(AutoModelForCausalLM, "ForCausalLM", likelihood_scores, "CAUSAL_LM"))


def saved_architectures(path: str, revision: str | None = None) -> list[str]:
    """The architectures the checkpoint at ``path`` was saved as (its config's ``architectures``)."""
    return AutoConfig.from_pretrained(path, revision=revision).architectures or []


def saved_head(path: str, revision: str | None = None) -> str:
    """The head of a saved reward model (or of a causal LM: ``likelihood``), from its architecture."""
    return head_of(saved_architectures(path, revision), path)


def head_of(architectures: list[str], path: str) -> str:
    """The head of the checkpoint at ``path``, saved as ``architectures``."""
    for name, head in REWARD_HEADS.items():
        if head.matches(architectures):
            return name
    raise ValueError(
        f"{path} is neither a sequence classifier nor a causal LM (architectures {architectures}): it cannot score "
        "completions as a reward model"
    )


def load_reward_model(
    path: str,
    revision: str | None = None,
    dtype: str = "auto",
    head: str | None = None,
    chat_template: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The reward model at ``path`` with ``head`` (None: the saved model's own, :func:`saved_head`),
    its tokenizer (whose padding token the model's config gets; with ``chat_template`` over its own)
    and the head's name. A classifier loaded from a causal LM gets a fresh score head
    (:func:`~trainers.models.pretrained.load_with_new_head`)."""
    architectures = saved_architectures(path, revision)
    head = head or head_of(architectures, path)
    spec = REWARD_HEADS.lookup(head)
    tokenizer = load_tokenizer(path, revision, chat_template)
    if spec.matches(architectures):
        model = spec.auto_class.from_pretrained(
            path, revision=revision, dtype=torch_dtype(dtype), **LOAD_OPTIONS, **dict(spec.load_options)
        )
    else:
        model = load_with_new_head(spec.auto_class, path, revision, dtype, **dict(spec.load_options))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, head


class RewardModelScorer:
    """A reward model as a GRPO reward function (TRL's contract, :mod:`trainers.grpo.rewards`): each
    prompt and completion, as the data has them, tokenized as the data preparation tokenizes a pair
    (:func:`~trainers.data.rows.render_prompt`, :func:`~trainers.data.rows.render_completion`), scored in
    batches of ``batch_size`` without gradient, padding-free as ``padding_free`` says
    (``compute.padding_free``). :meth:`to` puts the model on a device (the policy's, or its own:
    ``grpo.reward_model_device``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        head: str,
        name: str,
        batch_size: int = 64,
        padding_free: PaddingFree = "auto",
    ):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.score = REWARD_HEADS.lookup(head).score
        self.packing = packing_for(self.model, padding_free)
        self.__name__ = name
        self.batch_size = batch_size

    def to(self, device: torch.device | str) -> RewardModelScorer:
        self.model.to(device)
        return self

    @torch.no_grad()
    def __call__(self, *, prompts: list, completions: list, truncated: Sequence[bool], **kwargs) -> list[float]:
        """A truncated completion is scored as cut: without EOS or end of turn (:func:`render_completion`)."""
        rendered = [
            (render_prompt(self.tokenizer, p), render_completion(self.tokenizer, c, p, ended=not cut))
            for p, c, cut in zip(prompts, completions, truncated, strict=True)
        ]
        return self.score_ids(rendered)

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
        """Scores of ``(prompt ids, completion ids)`` pairs, in batches of ``batch_size``."""
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            part = sequences[start : start + self.batch_size]
            batch = prompt_completion_batch(
                [list(p) for p, _ in part], [list(c) for _, c in part], self.tokenizer.pad_token_id
            )
            scores += self.score(self.model, {k: v.to(device) for k, v in batch.items()}, self.packing).float().tolist()
        return scores


def load_scorer(
    path: str, revision: str | None, dtype: str, device, name: str, padding_free: PaddingFree
) -> RewardModelScorer:
    """The saved reward model at ``path`` as a scorer on ``device``, named ``name`` in logs."""
    model, tokenizer, head = load_reward_model(path, revision, dtype)
    return RewardModelScorer(model, tokenizer, head, name, padding_free=padding_free).to(device)
