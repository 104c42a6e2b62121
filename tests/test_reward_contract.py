"""Reward functions follow TRL's contract (issue 25, finding 5): keyword calls with the prompts as
the data has them (messages or strings), conversational completions as assistant messages,
``completion_ids``, ``trainer_state`` and every other column. The TRL functions below are the
examples of TRL's GRPO documentation, re-typed; each runs unchanged on rows prepared from data by
``trainers.data.rows`` and completions written by a fixture policy."""

from __future__ import annotations

import math
import re

import pytest
from helpers import chat_tokenizer
from policies import pair_grpo, scripted_policy
from transformers import TrainerState

from trainers.data.rows import Truncation, render_rows, truncate_rows
from trainers.grpo.rewards import RewardError, check_signature, correctness, score_completions

pytestmark = pytest.mark.unit


# --- TRL's documented examples ---------------------------------------------------------------------
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def conversational_reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# --------------------------------------------------------------------------------------------------
BOXED = ["\\", "b", "o", "x", "e", "d", "{", "4", "}"]  # the policy's answer: \boxed{4}, every character once


def rollout(rows: list[dict], end: str, rewards, **options):
    """Prepare ``rows`` as GRPO prompts with the ChatML tokenizer, let the policy answer ``\\boxed{4}``
    then ``end``, and score two completions of the first row; returns what a recording reward saw
    and the sample table."""
    tokenizer = chat_tokenizer("chatml")
    prepared = truncate_rows(render_rows(rows, "grpo_prompts", tokenizer), Truncation(256, 128)).rows
    seen = {}

    def record(**kwargs):
        seen.update(kwargs)
        return [0.0] * len(kwargs["completions"])

    model = scripted_policy(tokenizer, [*BOXED, end])
    trainer = pair_grpo(model, tokenizer, prepared, [*rewards, record], options.pop("output_dir"), 12, **options)
    trainer.generate_and_score(trainer.model, [prepared[0]] * 2)
    answer_ids = tokenizer.convert_tokens_to_ids([*BOXED, end])  # the stop token included, as TRL's
    assert seen["completion_ids"] == [answer_ids, answer_ids]
    assert isinstance(seen["trainer_state"], TrainerState)
    return seen, trainer.latest_samples


def test_conversational_rows_reach_rewards_as_messages_and_trl_rewards_run_unchanged(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "ground_truth": "4", "level": 1}]
    seen, table = rollout(
        rows, "<|im_end|>", [format_reward_func, conversational_reward_func], output_dir=str(tmp_path)
    )
    assert seen["prompts"] == [[{"role": "user", "content": "2+2?"}]] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": "\\boxed{4}"}]] * 2
    assert (seen["ground_truth"], seen["level"]) == (["4", "4"], [1, 1])  # every column, typed as in the data
    assert table["rewards/format_reward_func"] == [0.0, 0.0]
    assert table["rewards/conversational_reward_func"] == [1.0, 1.0]


def test_standard_rows_reach_rewards_as_strings(tmp_path):
    rows = [{"prompt": "2+2?\n", "ground_truth": "4"}]
    seen, table = rollout(rows, "<|endoftext|>", [reward_len, reward_func], output_dir=str(tmp_path))
    assert (seen["prompts"], seen["completions"]) == (["2+2?\n"] * 2, ["\\boxed{4}"] * 2)
    assert table["rewards/reward_len"] == [-abs(20 - 9)] * 2 and table["rewards/reward_func"] == [1.0, 1.0]


def test_rendered_inputs_give_the_templates_prompt_text_and_plain_completions(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "ground_truth": "4"}]
    seen, table = rollout(rows, "<|im_end|>", [reward_func], output_dir=str(tmp_path), reward_inputs="rendered")
    assert seen["prompts"] == ["<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"] * 2
    assert seen["completions"] == ["\\boxed{4}"] * 2
    assert seen["ground_truth"] == ["4", "4"] and table["rewards/reward_func"] == [1.0, 1.0]


def test_completion_ids_end_with_the_stop_token_as_trls_and_a_truncated_completion_has_none(tmp_path):
    """TRL hands a reward the sampled ids up to and including the EOS: a reward written for TRL that
    reads them (a length penalty, a check of the last id) scores the same here. The policy answers
    a prompt ending in a newline with ``42`` and EOS, and any other prompt with ``x`` until the limit."""
    tokenizer = chat_tokenizer("chatml")
    rows = [{"prompt": "2+2?\n"}, {"prompt": "2+2="}]
    prepared = truncate_rows(render_rows(rows, "grpo_prompts", tokenizer), Truncation(256, 128)).rows
    seen = {}

    def trl_length_and_stop(completion_ids, **kwargs):
        seen.update(kwargs, completion_ids=completion_ids)
        return [-len(ids) + (ids[-1] == tokenizer.eos_token_id) for ids in completion_ids]

    model = scripted_policy(tokenizer, ["4", "2", "<|endoftext|>"])
    trainer = pair_grpo(model, tokenizer, prepared, [trl_length_and_stop], tmp_path, 6)
    trainer.generate_and_score(trainer.model, prepared)
    four, two, x = tokenizer.convert_tokens_to_ids(["4", "2", "x"])
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>") == 4
    assert seen["completion_ids"] == [[four, two, 4], [x] * 6]
    assert seen["completions"] == ["42", "xxxxxx"]  # the texts, as TRL decodes them: no special token
    assert trainer.latest_samples["rewards/trl_length_and_stop"] == [-3 + 1, -6]


def test_builtin_rewards_read_message_completions_and_answers_of_any_type():
    completions = [[{"role": "assistant", "content": " 4 "}], [{"role": "assistant", "content": "5"}]]
    assert correctness(prompts=[[], []], completions=completions, answer=[4, "4"]) == [1.0, 0.0]


def test_a_reward_without_kwargs_is_refused_and_a_failing_one_is_named():
    def positional(prompts, completions):
        return [0.0]

    with pytest.raises(ValueError, match=r"'positional' has the signature \(prompts, completions\); it must accept"):
        check_signature("positional", positional)
    assert check_signature("trl", reward_len) is reward_len  # TRL's (completions, **kwargs) is the contract

    def raises(completions, **kwargs):
        raise KeyError("ground_truth")

    def text(completions, **kwargs):
        return ["1.0" for _ in completions]

    kwargs = {"prompts": ["p"], "completions": ["c"], "completion_ids": [[1]]}
    with pytest.raises(RewardError, match="reward function 'raises' raised KeyError: 'ground_truth'"):
        score_completions([("raises", raises)], kwargs)
    with pytest.raises(RewardError, match=r"reward function 'text' returned '1.0' \(str\) for completion 0"):
        score_completions([("text", text)], kwargs)

    def infinite(completions, **kwargs):
        return [float("-inf") for _ in completions]

    def not_applicable(completions, **kwargs):
        return [float("nan") for _ in completions]

    with pytest.raises(RewardError, match="'infinite' returned -inf for completion 0: rewards are finite"):
        score_completions([("infinite", infinite)], kwargs)
    assert math.isnan(score_completions([("nan", not_applicable)], kwargs)[0][0])  # nan is None: not scored
