"""Fixture policies for tests that need exact completions: a bigram table instead of a model."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class ScriptedPolicy(LlamaForCausalLM):
    """A fixture policy: whatever the context, the token after ``a`` is ``script[a]`` (a bigram table
    as logits, so greedy decoding and sampling both follow it); a token off the script is followed
    by ``filler``."""

    def __init__(self, config: LlamaConfig, script: dict[int, int], filler: int):
        super().__init__(config)
        self.table = torch.full((config.vocab_size, config.vocab_size), -1e4)
        self.table[:, filler] = 0.0
        for current, following in script.items():
            self.table[current] = -1e4
            self.table[current, following] = 0.0

    def forward(self, input_ids=None, **kwargs):
        output = super().forward(input_ids=input_ids, **kwargs)
        output.logits = self.table[input_ids][:, -output.logits.shape[1] :]
        return output


def scripted_policy(tokenizer, after_prompt: list[str], eos_ids: int | list[int] | None = None) -> ScriptedPolicy:
    """A policy that answers a prompt ending in ``"\n"`` with the tokens ``after_prompt`` (each
    appears once), then repeats ``"x"``; its ``generation_config`` lists ``eos_ids`` (by default the
    tokenizer's EOS)."""
    ids = tokenizer.convert_tokens_to_ids(["\n", *after_prompt])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id if eos_ids is None else eos_ids,
    )
    model = ScriptedPolicy(config, dict(zip(ids, ids[1:])), filler=tokenizer.convert_tokens_to_ids("x"))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def chat_prompt(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
