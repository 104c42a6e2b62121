"""Evaluation of a causal LM on verifiable prompts and on held-out preference pairs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainers.collators import PreferenceCollator
from trainers.dpo import reward_metrics
from trainers.logprobs import completion_logps


@dataclass(frozen=True)
class GenerationSpec:
    max_new_tokens: int = 8
    num_samples: int = 4
    temperature: float = 1.0
    batch_size: int = 256
    seed: int = 0


def pad_left(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_token_id] * (width - len(s)) + s for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    *,
    do_sample: bool,
    num_return_sequences: int,
    spec: GenerationSpec,
) -> list[list[str]]:
    """``num_return_sequences`` decoded completions per prompt (special tokens removed)."""
    model.eval()
    torch.manual_seed(spec.seed)
    sampling = {"do_sample": True, "temperature": spec.temperature, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    completions: list[list[str]] = []
    for start in range(0, len(prompts), spec.batch_size):
        input_ids, attention_mask = pad_left(prompts[start : start + spec.batch_size], tokenizer.pad_token_id)
        output = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=spec.max_new_tokens,
            num_return_sequences=num_return_sequences,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        completions += [texts[i : i + num_return_sequences] for i in range(0, len(texts), num_return_sequences)]
    return completions


def exact_match(completion: str, answer: str) -> bool:
    return completion.strip() == answer.strip()


def answer_accuracy(model, tokenizer, rows: list[dict], spec: GenerationSpec) -> dict[str, float]:
    """Greedy accuracy and sampled accuracy (mean over ``num_samples`` samples per prompt)."""
    prompts, answers = [r["prompt_ids"] for r in rows], [r["answer"] for r in rows]
    greedy = generate_completions(model, tokenizer, prompts, do_sample=False, num_return_sequences=1, spec=spec)
    sampled = generate_completions(model, tokenizer, prompts, do_sample=True, num_return_sequences=spec.num_samples, spec=spec)
    greedy_hits = [exact_match(c[0], a) for c, a in zip(greedy, answers)]
    sampled_hits = [exact_match(s, a) for c, a in zip(sampled, answers) for s in c]
    return {
        "greedy_accuracy": sum(greedy_hits) / len(greedy_hits),
        "sampled_accuracy": sum(sampled_hits) / len(sampled_hits),
    }


@torch.no_grad()
def preference_rewards(model, tokenizer, rows: list[dict], beta: float, batch_size: int = 256) -> dict[str, float]:
    """Held-out implicit-reward accuracy and margin, against the cached ``ref_*`` log-probs."""
    model.eval()
    collate = PreferenceCollator(tokenizer.pad_token_id)
    totals = {"rewards/accuracies": 0.0, "rewards/margins": 0.0}
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size])
        logps = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"]).logps
        n = len(batch["ref_chosen_logps"])
        metrics = reward_metrics(beta * (logps[:n] - batch["ref_chosen_logps"]), beta * (logps[n:] - batch["ref_rejected_logps"]))
        for name in totals:
            totals[name] += metrics[name].item() * n
    return {name: value / len(rows) for name, value in totals.items()}
