"""Generation stops where the model's turn ends, not only at the tokenizer's EOS: the stop set of a
Qwen2.5-base-style tokenizer (EOS ``<|endoftext|>``, turns closed by ``<|im_end|>``) and of a
Llama-3.0-style ``generation_config`` (EOS ids ``[<|end_of_text|>, <|eot_id|>]``), and what GRPO and
evaluation make of a fixture policy that writes past its end of turn."""

from __future__ import annotations

import pytest
from helpers import chat_tokenizer
from policies import chat_prompt, pair_grpo, scripted_policy
from transformers import GenerationConfig

from trainers.evaluation.evaluate import GenerationSpec, generate_completions, score_prompts
from trainers.models.builtin import build_char_tokenizer
from trainers.models.stop_tokens import end_of_turn_id, stop_token_ids

pytestmark = pytest.mark.unit


def token_ids(tokenizer, *tokens: str) -> tuple[int, ...]:
    return tuple(tokenizer.convert_tokens_to_ids(list(tokens)))


def test_the_stop_set_adds_the_templates_end_of_turn_and_every_configured_eos_id():
    chatml, llama3 = chat_tokenizer("chatml"), chat_tokenizer("llama3")
    assert stop_token_ids(chatml) == token_ids(chatml, "<|endoftext|>", "<|im_end|>")  # a Qwen2.5 base model
    assert end_of_turn_id(llama3) == llama3.convert_tokens_to_ids("<|eot_id|>")
    llama3.chat_template = None  # a Llama-3.0 base release: no template, both ids in its generation_config
    configured = GenerationConfig(eos_token_id=list(token_ids(llama3, "<|end_of_text|>", "<|eot_id|>")))
    assert stop_token_ids(llama3) == token_ids(llama3, "<|end_of_text|>")
    assert stop_token_ids(llama3, configured) == token_ids(llama3, "<|end_of_text|>", "<|eot_id|>")
    builtin = build_char_tokenizer()  # its template ends a turn with EOS: nothing is added
    assert stop_token_ids(builtin, GenerationConfig(eos_token_id=builtin.eos_token_id)) == (builtin.eos_token_id,)
    chatml.chat_template = "{% for m in messages %}{{ m['content'] }}<end_of_turn>\n{% endfor %}"  # plain text
    assert end_of_turn_id(chatml) is None and stop_token_ids(chatml) == token_ids(chatml, "<|endoftext|>")


def test_evaluation_cuts_each_answer_at_the_end_of_turn():
    tokenizer = chat_tokenizer("chatml")
    model = scripted_policy(tokenizer, ["f", "h", "<|im_end|>", "b", "d", "<|endoftext|>"])
    spec = GenerationSpec(max_new_tokens=8, num_samples=2, seed=3)
    prompts = [chat_prompt(tokenizer)] * 2
    for do_sample, n in ((False, 1), (True, 2)):
        completions = generate_completions(
            model, tokenizer, prompts, do_sample=do_sample, num_return_sequences=n, spec=spec
        )
        assert [[(c.text, c.num_tokens) for c in row] for row in completions] == [[("fh", 3)] * n] * 2


def test_evaluation_samples_show_the_prompt_as_rendered_and_score_the_cut_answer():
    tokenizer = chat_tokenizer("chatml")
    model = scripted_policy(tokenizer, ["f", "h", "<|im_end|>", "b", "d", "<|endoftext|>"])
    row = {"prompt_ids": chat_prompt(tokenizer), "answer": "fh"}
    (result,) = score_prompts(model, tokenizer, [row], GenerationSpec(max_new_tokens=8, num_samples=1))
    assert result.prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"  # as GRPO's tables show it
    assert result.greedy_correct and result.samples_correct == [True]


def test_evaluation_stops_at_a_llama3_generation_configs_second_eos_id():
    tokenizer = chat_tokenizer("llama3")
    tokenizer.chat_template = None
    eos_ids = list(token_ids(tokenizer, "<|end_of_text|>", "<|eot_id|>"))
    model = scripted_policy(tokenizer, ["4", "<|eot_id|>", "5", "6"], eos_ids=eos_ids)
    prompt = tokenizer("2+2?\n", add_special_tokens=False).input_ids
    spec = GenerationSpec(max_new_tokens=6)
    (greedy,) = generate_completions(model, tokenizer, [prompt], do_sample=False, num_return_sequences=1, spec=spec)
    assert (greedy[0].text, greedy[0].num_tokens) == ("4", 2)


def test_grpo_rollouts_stop_at_the_end_of_turn_and_rewards_see_the_answer_only(tmp_path):
    tokenizer = chat_tokenizer("chatml")
    model = scripted_policy(tokenizer, ["f", "h", "<|im_end|>", "b", "d", "j"])
    seen = []

    def exact_answer(prompts, completions, completion_ids, **columns):
        seen.append((list(completions), [list(ids) for ids in completion_ids]))
        return [float(text == "fh") for text in completions]

    prompt = chat_prompt(tokenizer)
    trainer = pair_grpo(model, tokenizer, [{"prompt_ids": prompt}] * 2, [exact_answer], tmp_path, 6)
    assert trainer.stop_ids == token_ids(tokenizer, "<|endoftext|>", "<|im_end|>")
    (slice_,) = trainer.generate_and_score(trainer.model, [{"prompt_ids": prompt}] * 2)
    answer = list(token_ids(tokenizer, "f", "h"))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert seen == [(["fh", "fh"], [answer + [end_of_turn]] * 2)]  # the ids end with the stop token, as TRL's
    assert slice_["input_ids"].tolist() == [prompt + answer + [end_of_turn]] * 2  # nothing after the end of turn
    assert slice_["completion_mask"].tolist() == [[0] * len(prompt) + [1, 1, 1]] * 2
