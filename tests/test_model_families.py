"""Real model families, end to end on conversational data (issue 25): Qwen2- and Llama-architecture
models with byte-level BPE tokenizers trained here, under ChatML, Llama-3 and Gemma templates, each
as a base release (EOS is not the end of turn) and an instruct one (the end of turn is among the
``generation_config`` EOS ids). For each: the prepared ids and labels token by token, GRPO
rollouts that stop at the end of turn with a TRL-style reward that receives messages, and
evaluation answers cut at the end of turn, on a fixture policy that writes past its turn."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from helpers import CHATML, GEMMA, LLAMA3
from policies import pair_grpo, scripted_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trainers.data.collators import IGNORE_INDEX, CompletionOnlyCollator
from trainers.data.rows import Truncation, normalize_rows, render_rows, truncate_rows
from trainers.evaluation.evaluate import GenerationSpec, score_prompts
from trainers.models.stop_tokens import stop_token_ids

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Family:
    """A model family's tokenizer and template: its special tokens, BOS, the EOS of its base and of
    its instruct release, its end-of-turn token, and how a user turn "2+2?" with the answer "42"
    renders, as pieces (a special token, or text that is tokenized on its own between them)."""

    template: str
    specials: tuple[str, ...]
    bos: str | None
    base_eos: str
    end_of_turn: str
    architecture: str
    prompt: tuple[str, ...]
    completion: tuple[str, ...]


FAMILIES = {
    "qwen2-chatml": Family(
        CHATML,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None,
        "<|endoftext|>",
        "<|im_end|>",
        "qwen2",
        ("<|im_start|>", "user\n2+2?", "<|im_end|>", "\n", "<|im_start|>", "assistant\n"),
        ("42", "<|im_end|>"),
    ),
    "llama3": Family(
        LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        "llama",
        (
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "user",
            "<|end_header_id|>",
            "\n\n2+2?",
            "<|eot_id|>",
            "<|start_header_id|>",
            "assistant",
            "<|end_header_id|>",
            "\n\n",
        ),
        ("42", "<|eot_id|>"),
    ),
    "gemma": Family(
        GEMMA,
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
        "<end_of_turn>",
        "llama",
        ("<bos>", "<start_of_turn>", "user\n2+2?", "<end_of_turn>", "\n", "<start_of_turn>", "model\n"),
        ("42", "<end_of_turn>"),
    ),
}
CORPUS = [
    "user assistant model system 2+2? 40 41 42 43 what is the sum\n\n",
    "The quick brown fox jumps over the lazy dog; xyz 0123456789 + = ?\n",
] * 20


def trained_tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a small corpus, with the family's special tokens and template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<pad>", *family.specials]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token=family.base_eos, bos_token=family.bos
    )
    tokenizer.chat_template = family.template
    return tokenizer


def piece_ids(tokenizer, pieces) -> list[int]:
    """Ids of ``pieces``: a special token as its id, text as its own tokens."""
    ids = []
    for piece in pieces:
        special = piece in tokenizer.get_added_vocab()
        ids += (
            [tokenizer.convert_tokens_to_ids(piece)]
            if special
            else tokenizer(piece, add_special_tokens=False).input_ids
        )
    return ids


VARIANTS = [(name, release) for name in FAMILIES for release in ("base", "instruct")]


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{n}-{r}" for n, r in VARIANTS])
def variant(request):
    name, release = request.param
    family = FAMILIES[name]
    tokenizer = trained_tokenizer(family)
    eos_ids = [tokenizer.eos_token_id]
    if release == "instruct":  # the instruct release's generation_config also ends at the end of turn
        eos_ids.append(tokenizer.convert_tokens_to_ids(family.end_of_turn))
    return family, tokenizer, eos_ids


ROW = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "42"}]}


def prepare(tokenizer, rows, split):
    rendered = render_rows(normalize_rows(rows, split, "inline"), split, tokenizer, "inline")
    return truncate_rows(rendered, Truncation(128, 64)).rows


def test_prepared_ids_and_labels_token_by_token(variant):
    family, tokenizer, _ = variant
    (row,) = prepare(tokenizer, [ROW], "sft")
    prompt, completion = piece_ids(tokenizer, family.prompt), piece_ids(tokenizer, family.completion)
    assert (row["prompt_ids"], row["completion_ids"]) == (prompt, completion)
    assert completion[-1] == tokenizer.convert_tokens_to_ids(family.end_of_turn)  # no trailing newline trained
    batch = CompletionOnlyCollator(tokenizer.pad_token_id)([row])
    assert batch["input_ids"][0].tolist() == prompt + completion
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] * len(prompt) + completion


def fixture_policy(family, tokenizer, eos_ids, prompt_ids):
    """Writes the answer "42", the end of turn, then text past it ("xyz"), then EOS."""
    answer = tokenizer("42", add_special_tokens=False).input_ids
    after = tokenizer("xyz", add_special_tokens=False).input_ids
    end = tokenizer.convert_tokens_to_ids(family.end_of_turn)
    chain = [prompt_ids[-1], *answer, end, *after, tokenizer.convert_tokens_to_ids(family.base_eos)]
    assert len(set(chain)) == len(chain)  # a bigram script: each id once
    filler = tokenizer("?", add_special_tokens=False).input_ids[-1]
    return scripted_model(tokenizer, chain, filler, eos_ids, family.architecture), answer, end


def test_grpo_rollouts_stop_at_the_end_of_turn_and_a_trl_reward_receives_messages(variant, tmp_path):
    family, tokenizer, eos_ids = variant
    rows = prepare(tokenizer, [{"prompt": ROW["messages"][:1], "answer": "42"}], "grpo_prompts")
    model, answer, end = fixture_policy(family, tokenizer, eos_ids, rows[0]["prompt_ids"])
    seen = {}

    def accuracy(completions, answer, **kwargs):  # TRL's conversational form
        seen.update(completions=completions, prompts=kwargs["prompts"])
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]

    trainer = pair_grpo(model, tokenizer, rows, [accuracy], tmp_path, 10)
    assert end in trainer.stop_ids and set(eos_ids) <= set(trainer.stop_ids)
    (slice_,) = trainer.generate_and_score(trainer.model, rows * 2)
    prompt = rows[0]["prompt_ids"]
    assert slice_["input_ids"].tolist() == [prompt + answer + [end]] * 2  # nothing after the end of turn
    assert slice_["completion_mask"].tolist() == [[0] * len(prompt) + [1] * (len(answer) + 1)] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": "42"}]] * 2
    assert seen["prompts"] == [[{"role": "user", "content": "2+2?"}]] * 2
    assert trainer.latest_samples["rewards/accuracy"] == [1.0, 1.0]


def test_evaluation_answers_are_cut_at_the_end_of_turn(variant):
    family, tokenizer, eos_ids = variant
    (row,) = prepare(tokenizer, [{"prompt": ROW["messages"][:1], "answer": "42"}], "eval_prompts")
    model, answer, _ = fixture_policy(family, tokenizer, eos_ids, row["prompt_ids"])
    assert (
        stop_token_ids(tokenizer, model.generation_config)[-1] == tokenizer.convert_tokens_to_ids(family.end_of_turn)
        or tokenizer.convert_tokens_to_ids(family.end_of_turn) in eos_ids
    )
    (result,) = score_prompts(model, tokenizer, [row], GenerationSpec(max_new_tokens=10, num_samples=2, seed=1))
    assert (result.greedy_correct, result.samples_correct) == (True, [True, True])
    assert result.prompt == tokenizer.decode(row["prompt_ids"])
