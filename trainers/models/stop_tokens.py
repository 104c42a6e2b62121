"""Where a completion ends: the model's end-of-sequence ids and its chat template's end of turn.

A tokenizer's ``eos_token_id`` is not always where a chat model stops. Qwen2.5 *base* models end
text with ``<|endoftext|>`` while their template closes an assistant turn with ``<|im_end|>``;
Llama-3.0 releases list ``[<|end_of_text|>, <|eot_id|>]`` in ``generation_config.eos_token_id``.
Generation stops at any id of :func:`stop_token_ids`, and a completion is cut at its first stop
token (:func:`cut_at_first_stop`) before it is decoded, scored or trained on. GRPO and evaluation
both take their stop set from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerBase

# An assistant message no template alters (no whitespace to trim, no marker of its own).
SENTINEL = "alignflowSTOPsentinel"


def rendered_text(rendered: object) -> str:
    """What ``apply_chat_template(conversation, tokenize=False)`` returns for one conversation: its
    text (transformers annotates the method with what any of its modes returns)."""
    if not isinstance(rendered, str):
        raise TypeError(f"the chat template rendered {type(rendered).__name__}, not text")
    return rendered


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message's content, read
    off a rendered turn; None without a template, where the template fails on a plain user/assistant
    exchange, or where the marker is plain text (it cannot stop generation as one id)."""
    if not tokenizer.chat_template:
        return None
    turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": SENTINEL}]
    try:
        rendered = tokenizer.apply_chat_template(turn, tokenize=False)
    except Exception:  # a template's own checks (jinja2's TemplateError, a raise_exception call)
        return None
    after = rendered_text(rendered).partition(SENTINEL)[2]
    specials = {token.content: i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    found = [content for content in specials if content and after.startswith(content)]
    return specials[max(found, key=len)] if found else None  # the longest, should one be a prefix of another


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None = None
) -> tuple[int, ...]:
    """The tokenizer's EOS and every id of ``generation_config.eos_token_id`` (an int or a list), in
    this order and without repeats: what a vLLM engine built from the model's folder stops at."""
    configured = generation_config.eos_token_id if generation_config is not None else None
    candidates = [tokenizer.eos_token_id, *(configured if isinstance(configured, (list, tuple)) else [configured])]
    return tuple(dict.fromkeys(int(i) for i in candidates if i is not None))


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None = None
) -> tuple[int, ...]:
    """The ids that end a completion, in this order and without repeats: :func:`eos_token_ids`, then
    the chat template's end of turn."""
    end_of_turn = end_of_turn_id(tokenizer)
    ids = tuple(
        dict.fromkeys(
            [*eos_token_ids(tokenizer, generation_config), *([end_of_turn] if end_of_turn is not None else [])]
        )
    )
    if not ids:
        raise ValueError(
            "no token ends a completion: the tokenizer has no eos_token, the model's generation_config no "
            "eos_token_id and its chat template no special end-of-turn token"
        )
    return ids


def cut_at_first_stop(generated: torch.Tensor, stop_ids: tuple[int, ...]) -> tuple[list[list[int]], list[bool]]:
    """Each generated row up to and including its first stop token; a row without one is kept whole
    and reported as truncated. Whatever follows the first stop token is dropped."""
    import torch  # here: data preparation uses this module's stop set without torch (the flows import none)

    is_stop = torch.isin(generated, torch.tensor(stop_ids, dtype=generated.dtype, device=generated.device))
    has_stop = is_stop.any(dim=1)
    ends = torch.where(has_stop, is_stop.int().argmax(dim=1) + 1, generated.shape[1])
    return [row[:end].tolist() for row, end in zip(generated, ends.tolist())], (~has_stop).tolist()
