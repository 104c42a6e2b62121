"""Fixture policies for tests that need exact completions: a bigram table instead of a model."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def bigram_logits(vocab: int, script: dict[int, int], filler: int) -> torch.Tensor:
    """``[vocab, vocab]`` logits: row ``a`` puts all its mass on ``script[a]``, a row off the script on ``filler``."""
    table = torch.full((vocab, vocab), -1e4)
    table[:, filler] = 0.0
    for current, following in script.items():
        table[current] = -1e4
        table[current, following] = 0.0
    return table


class Scripted:
    """A fixture policy (mixed into a causal LM class): whatever the context, the token after ``a``
    is ``script[a]`` (a bigram table as logits, so greedy decoding and sampling both follow it); a
    token off the script is followed by ``filler``."""

    def __init__(self, config, script: dict[int, int], filler: int):
        super().__init__(config)
        self.table = bigram_logits(config.vocab_size, script, filler)

    def forward(self, input_ids=None, **kwargs):
        output = super().forward(input_ids=input_ids, **kwargs)
        output.logits = self.table[input_ids][:, -output.logits.shape[1] :]
        return output


SCRIPTED = {
    name: type(f"Scripted{model.__name__}", (Scripted, model), {}) for name, (_, model) in ARCHITECTURES.items()
}


def scripted_model(
    tokenizer, chain: list[int], filler: int, eos_ids: int | list[int] | None = None, architecture: str = "llama"
):
    """A tiny ``architecture`` model that writes ``chain[1:]`` after ``chain[0]`` (each id appears
    once in the chain), then ``filler``; its ``generation_config`` lists ``eos_ids`` (by default the
    tokenizer's EOS)."""
    config_class, _ = ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id if eos_ids is None else eos_ids,
    )
    model = SCRIPTED[architecture](config, dict(zip(chain, chain[1:])), filler=filler)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def scripted_policy(tokenizer, after_prompt: list[str], eos_ids: int | list[int] | None = None):
    """A policy that answers a prompt ending in ``"\n"`` with the tokens ``after_prompt`` (each
    appears once), then repeats ``"x"``."""
    chain = tokenizer.convert_tokens_to_ids(["\n", *after_prompt])
    return scripted_model(tokenizer, chain, tokenizer.convert_tokens_to_ids("x"), eos_ids)


def chat_prompt(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


# A short GRPO run on the tiny model: two completions per prompt, four tokens each, a log per step.
SHORT_GRPO = dict(
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
)


def grpo_args(output_dir, **settings):
    """``GRPOConfig`` for a test run: no reporting, no progress bars, no pinned memory."""
    from trainers.grpo.trainer import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir), report_to=[], disable_tqdm=True, dataloader_pin_memory=False, **settings
    )


def pair_grpo(model, tokenizer, rows: list[dict], rewards, output_dir, max_completion_length: int, **options):
    """A GRPO trainer over ``rows`` that samples two completions of one prompt per generation."""
    import datasets

    from trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(output_dir),
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=max_completion_length,
        **options,
    )
    return GRPOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        reward_funcs=rewards,
    )


def scripted_checkpoint(tokenizer, after_prompt: list[str], folder):
    """:func:`scripted_policy`'s bigram table as the weights of a plain ``LlamaForCausalLM``, saved
    with ``tokenizer`` in ``folder``: loaded with ``from_pretrained``, as every stage and evaluation
    loads a model. The layer adds nothing (its output projections are zero), the embeddings are the
    identity (the hidden size is the vocabulary's), so the final RMSNorm turns token ``a`` into
    ``sqrt(V)·e_a``, and the head's column ``a`` holds the table's row ``a`` divided by ``sqrt(V)``."""
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=vocab,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        rms_norm_eps=0.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    chain = tokenizer.convert_tokens_to_ids(["\n", *after_prompt])
    table = bigram_logits(vocab, dict(zip(chain, chain[1:])), tokenizer.convert_tokens_to_ids("x"))
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(table.T / vocab**0.5)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
