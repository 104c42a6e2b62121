"""``DPOTrainer``: a ``transformers.Trainer`` whose ``compute_loss`` is a preference loss.

Per step: one forward of the policy over the concatenated ``[chosen; rejected]`` batch, summed
completion log-probs, reference log-probs from cached columns (default), a live frozen
reference model, or zeros (reference-free), then the registered loss chosen by ``loss_type``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments

from trainers.collators import REF_COLUMNS
from trainers.logprobs import completion_logps
from trainers.losses import get_loss


@dataclass
class DPOConfig(TrainingArguments):
    beta: float = field(default=0.1, metadata={"help": "Scale of the log-ratio difference inside the loss."})
    loss_type: str = field(default="sigmoid", metadata={"help": "Name of a registered preference loss."})
    reference_free: bool = field(default=False, metadata={"help": "Take reference log-probs as 0."})
    remove_unused_columns: bool = False

    def __post_init__(self):
        super().__post_init__()
        get_loss(self.loss_type)  # fail at configuration time, not at the first step


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """Implicit rewards β·(π − ref): their means, the margin and how often chosen wins."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }


class DPOTrainer(Trainer):
    def __init__(self, *args, ref_model: PreTrainedModel | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = get_loss(self.args.loss_type)
        self.ref_model = None
        if ref_model is not None:
            ref_model.requires_grad_(False).eval()
            self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        self.window_metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def reference_logps(self, inputs: dict[str, torch.Tensor], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if all(column in inputs for column in REF_COLUMNS):
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        if self.ref_model is not None:
            with torch.no_grad():
                ref = completion_logps(
                    self.ref_model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
                )
            return ref[:batch_size], ref[batch_size:]
        if self.args.reference_free:
            zeros = torch.zeros(batch_size, device=inputs["input_ids"].device)
            return zeros, zeros
        raise ValueError("no reference: give cached ref_* columns, a ref_model, or set reference_free=True")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch_size = inputs["input_ids"].shape[0] // 2
        logps = completion_logps(model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"])
        chosen_logps, rejected_logps = logps[:batch_size], logps[batch_size:]
        ref_chosen, ref_rejected = self.reference_logps(inputs, batch_size)
        losses = self.loss_fn(chosen_logps, rejected_logps, ref_chosen, ref_rejected, beta=self.args.beta)
        loss = losses.mean()

        beta = self.args.beta
        metrics = reward_metrics(beta * (chosen_logps - ref_chosen).detach(), beta * (rejected_logps - ref_rejected).detach())
        metrics["logps/chosen"] = chosen_logps.detach().mean()
        metrics["logps/rejected"] = rejected_logps.detach().mean()
        metrics["num_tokens"] = inputs["attention_mask"].sum().float()
        self.record_metrics(metrics, "train" if model.training else "eval")
        return (loss, {"chosen_logps": chosen_logps, "rejected_logps": rejected_logps}) if return_outputs else loss

    def record_metrics(self, metrics: dict[str, torch.Tensor], mode: str) -> None:
        names = list(metrics)
        gathered = self.accelerator.gather_for_metrics(torch.stack([metrics[n] for n in names]).unsqueeze(0))
        for name, value in zip(names, gathered.float().mean(0).tolist()):
            self.window_metrics[mode][name].append(value)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the DPO metrics, averaged over the logging window, to the Trainer's logs."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self.window_metrics[mode].items():
            logs[prefix + name] = sum(values) / len(values)
        self.window_metrics[mode].clear()
        super().log(logs, start_time)
