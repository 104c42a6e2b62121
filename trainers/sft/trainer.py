"""``SFTTrainer``: the ``Trainer`` with the negative log-likelihood of the completion tokens (the
collator's ``labels``) computed by the shared log-prob pass (padding-free where the attention
supports it, the vocabulary projected at completion positions only, in chunks), and packed epochs
when the section sets a token budget (``batch_tokens``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import DataLoader
from transformers import PreTrainedModel, Trainer

from trainers.data.collators import IGNORE_INDEX
from trainers.data.packing import TokenBudgetBatches
from trainers.models.attention import packing_for
from trainers.models.transformers_compat import window_loss_scale
from trainers.runtime.arguments import PassArguments
from trainers.scoring.logprobs import completion_logps
from trainers.sections import section_fields
from trainers.sft.section import SFTConfig


@dataclass
@section_fields(SFTConfig)
class SFTArguments(PassArguments):
    """``PassArguments`` plus the SFT section's fields (``batch_tokens``)."""

    remove_unused_columns: bool = False  # the collator reads prompt_ids / completion_ids


class SFTTrainer(Trainer):
    args: SFTArguments
    model: PreTrainedModel  # or a PeftModel around one, which forwards its attributes
    # compute_loss divides by the accumulation window's num_items_in_batch, whatever the model's forward
    # accepts; without a count (evaluation) it is the batch's mean
    loss_is_scaled_for_ga = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packing = packing_for(self.model, self.args.padding_free)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``−Σ_t m_t log p(x_t | x_<t) / n``, ``m_t`` marking the completion tokens (labels other than
        −100) and ``n`` the accumulation window's count of them (``num_items_in_batch``, as the Trainer
        counts it for the causal-LM loss), or this batch's count: the loss transformers' causal LMs
        compute from ``labels``, without a logit at a prompt position."""
        completion = inputs["labels"].ne(IGNORE_INDEX)
        scored = completion_logps(
            model, inputs["input_ids"], inputs["attention_mask"], completion.long(), packing=self.packing
        )
        if num_items_in_batch is None:
            loss = -scored.logps.sum() / scored.num_tokens.sum()
        else:
            loss = -scored.logps.sum() / num_items_in_batch * window_loss_scale(self)
        return (loss, {"logps": scored.logps}) if return_outputs else loss

    def get_train_dataloader(self) -> DataLoader:
        """With ``batch_tokens``: batches of at most that many tokens (:class:`TokenBudgetBatches`,
        every row once an epoch) instead of ``per_device_train_batch_size`` rows, sharded over the
        processes by ``accelerator.prepare``."""
        budget = self.args.batch_tokens
        if budget is None:
            return super().get_train_dataloader()
        if self.train_dataset is None or self.data_collator is None:
            raise ValueError("SFTTrainer: packed epochs need a train_dataset and a data_collator")
        lengths = [
            len(prompt) + len(completion)
            for prompt, completion in zip(self.train_dataset["prompt_ids"], self.train_dataset["completion_ids"])
        ]
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        loader = DataLoader(
            self.train_dataset,
            batch_sampler=TokenBudgetBatches(lengths, budget, seed),
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)
