"""The reward-model stage: the Bradley–Terry loss against its formula written here (float64, value
and gradient), the pair collator, the config checks, the trainer's loss against per-sequence scores,
training to held-out pairwise accuracy, and the saved model scoring completions as a GRPO reward."""

from __future__ import annotations

import logging
import math
import re
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
from helpers import QUIET_TRAINING, chat_tokenizer
from policies import chat_prompt, pair_grpo, scripted_policy
from pydantic import ValidationError

from infra.core.config import load_config
from trainers.data.rows import TemplateError, Truncation, render_completion, render_rows, truncate_rows
from trainers.grpo.rewards import resolve_rewards
from trainers.reward.losses import bradley_terry_losses
from trainers.reward.section import RewardHeadName
from trainers.reward.trainer import PairSequenceCollator, RewardConfig, RewardTrainer
from trainers.scoring.reward_model import REWARD_HEADS, RewardModelScorer, load_reward_model, saved_head


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.unit
@pytest.mark.parametrize("margin, center", [(None, None), ([0.5, -0.2, 1.0], None), (None, 0.01), ([0.3, 0, 2], 0.1)])
def test_bradley_terry_matches_its_formula_in_float64_with_its_gradient(margin, center):
    rc, rr = [0.7, -0.4, 1.5], [0.2, 0.3, -1.0]
    chosen = torch.tensor(rc, dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor(rr, dtype=torch.float64, requires_grad=True)
    m = [0.0] * 3 if margin is None else margin
    c = center or 0.0
    got = bradley_terry_losses(
        chosen, rejected, None if margin is None else torch.tensor(margin, dtype=torch.float64), center
    )
    want = [-log_sigmoid(a - b - k) + c * (a + b) ** 2 for a, b, k in zip(rc, rr, m)]
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    got.sum().backward()
    # dL/dr_c = −(1 − σ(d)) + 2c(r_c + r_r), dL/dr_r = (1 − σ(d)) + 2c(r_c + r_r), d = r_c − r_r − m
    tail = [1 - 1 / (1 + math.exp(-(a - b - k))) for a, b, k in zip(rc, rr, m)]
    center_grad = [2 * c * (a + b) for a, b in zip(rc, rr)]
    assert chosen.grad.tolist() == pytest.approx([-t + g for t, g in zip(tail, center_grad)], abs=1e-12)
    assert rejected.grad.tolist() == pytest.approx([t + g for t, g in zip(tail, center_grad)], abs=1e-12)


@pytest.mark.unit
def test_the_collator_puts_every_chosen_sequence_before_every_rejected_one():
    pairs = [
        {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3, 4], "margin": 0.5},
        {"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8], "margin": 2},
    ]
    batch = PairSequenceCollator(pad_token_id=0)(pairs)
    assert batch["input_ids"].tolist() == [[1, 2, 0], [5, 6, 7], [1, 3, 4], [5, 6, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert batch["completion_mask"].tolist() == [[0, 1, 0], [0, 0, 1], [0, 1, 1], [0, 0, 1]]
    assert batch["margin"].tolist() == [0.5, 2.0]


@pytest.mark.unit
def test_the_heads_of_the_section_are_the_registered_heads_and_the_docs_list_them():
    assert set(typing.get_args(RewardHeadName)) == set(REWARD_HEADS)
    page = (Path(__file__).resolve().parents[1] / "docs" / "algorithms" / "reward.md").read_text()
    assert all(f"| `{name}`" in page for name in REWARD_HEADS)
    assert load_config(None, ["reward.head=likelihood"]).reward.head == "likelihood"
    with pytest.raises(ValidationError, match="reward.head"):
        load_config(None, ["reward.head=value"])


@pytest.mark.unit
def test_reward_models_in_the_config_name_an_earlier_reward_stage_or_a_path():
    config = load_config(None, ["stages=[sft, reward, grpo]", "grpo.reward_funcs=[model:reward, format]"])
    assert config.grpo.reward_funcs == ["model:reward", "format"]
    assert load_config(None, ["grpo.reward_funcs=[model:/models/rm]"]).grpo.reward_funcs == ["model:/models/rm"]
    refused = {
        "must be a reward stage listed before grpo": [
            "stages=[sft, grpo, reward, dpo]",
            "grpo.reward_funcs=[model:reward]",
        ],
        "model:sft names a stage; it must be a reward stage": ["grpo.reward_funcs=[model:sft]"],
        "the last stage, reward, trains a reward model": ["stages=[sft, reward]"],
        "name a reward stage \\(model:reward\\) or a model path": ["grpo.reward_funcs=['model:']"],
        "reward_weights has 1 values for 2 reward_funcs": [
            "grpo.reward_funcs=[model:x, format]",
            "grpo.reward_weights=[1]",
        ],
        "scores prompts and completions as the data has them": [
            "grpo.reward_funcs=[model:x]",
            "grpo.reward_inputs=rendered",
        ],
    }
    for message, overrides in refused.items():
        with pytest.raises(ValidationError, match=message):
            load_config(None, overrides)
    with pytest.raises(ValueError, match="names a reward model: pass it loaded"):
        resolve_rewards(["model:reward"])


@pytest.fixture(scope="module")
def reward_start(tiny, tmp_path_factory):
    """The built-in model saved as a causal LM checkpoint: a reward stage's starting point."""
    model, tokenizer = tiny
    folder = tmp_path_factory.mktemp("reward-start")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def sequence_reward(model, ids: list[int]) -> torch.Tensor:
    """The score head at the sequence's last token, from the unpadded sequence alone."""
    return model(torch.tensor([ids])).logits[0, 0]


@contextmanager
def records_of(name: str) -> Iterator[list[logging.LogRecord]]:
    """What the logger ``name`` hands to its handlers meanwhile (transformers' own may not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.unit
def test_a_classifier_from_a_causal_lm_says_its_head_is_new_in_one_line_and_other_missing_weights_keep_the_report(
    reward_start, tiny, tmp_path, caplog
):
    from transformers import AutoModelForSequenceClassification

    from trainers.models.pretrained import LOAD_REPORT_LOGGER

    with records_of(LOAD_REPORT_LOGGER) as plain:  # transformers' own report of the new head, a warning table
        AutoModelForSequenceClassification.from_pretrained(reward_start, num_labels=1)
    assert [r.levelname for r in plain] == ["WARNING"] and "score.weight" in plain[0].getMessage()

    caplog.clear()
    with records_of(LOAD_REPORT_LOGGER) as report, caplog.at_level(logging.INFO, logger="trainers.models.pretrained"):
        load_reward_model(reward_start, head="classifier")
    assert report == []
    assert caplog.messages == [
        f"{reward_start}: a new LlamaForSequenceClassification head, score.weight initialised fresh"
    ]

    model, tokenizer = tiny
    weights = {name: value for name, value in model.state_dict().items() if name != "model.norm.weight"}
    model.save_pretrained(tmp_path, state_dict=weights)
    tokenizer.save_pretrained(tmp_path)
    caplog.clear()
    with records_of(LOAD_REPORT_LOGGER) as report, caplog.at_level(logging.INFO, logger="trainers.models.pretrained"):
        load_reward_model(str(tmp_path), head="classifier")
    (table,) = report
    assert {"model.norm.weight", "score.weight"} <= set(re.findall(r"[\w.]+\.weight", table.getMessage()))
    assert [r for r in caplog.records if r.name == "trainers.models.pretrained"] == []


@pytest.mark.unit
def test_the_trainers_loss_equals_the_per_sequence_formula(reward_start, tiny_pairs, tmp_path):
    model, tokenizer, head = load_reward_model(reward_start, head="classifier")
    assert head == "classifier"
    model = model.double()
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a non-trivial head: scores differ between sequences
    args = RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=0.05, **QUIET_TRAINING)
    trainer = RewardTrainer(model=model, args=args, train_dataset=tiny_pairs[:4])
    pairs = tiny_pairs[:3]
    loss = trainer.compute_loss(model, PairSequenceCollator(tokenizer.pad_token_id)(pairs))
    total = 0
    for pair in pairs:
        rc = sequence_reward(model, pair["prompt_ids"] + pair["chosen_ids"])
        rr = sequence_reward(model, pair["prompt_ids"] + pair["rejected_ids"])
        total = total - torch.nn.functional.logsigmoid(rc - rr) + 0.05 * (rc + rr) ** 2
    assert loss.item() == pytest.approx((total / len(pairs)).item(), abs=1e-6)
    assert loss.item() != pytest.approx(math.log(2), abs=1e-3)


def mean_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(1/|y|) Σ_t log p(y_t | x, y_<t) of one unpadded sequence, with plain log_softmax."""
    ids = prompt + completion
    logits = model(torch.tensor([ids])).logits[0]
    positions = range(len(prompt) - 1, len(ids) - 1)
    return sum(torch.log_softmax(logits[p], -1)[ids[p + 1]] for p in positions) / len(completion)


@pytest.mark.unit
def test_the_likelihood_heads_loss_and_gradient_and_its_scores_equal_the_mean_log_prob_formula(
    reward_start, tiny_pairs, tmp_path
):
    model, tokenizer, head = load_reward_model(reward_start, head="likelihood")
    assert head == "likelihood" and type(model).__name__ == "LlamaForCausalLM"
    model = model.double()
    args = RewardConfig(output_dir=str(tmp_path), head="likelihood", **QUIET_TRAINING)
    trainer = RewardTrainer(model=model, args=args, train_dataset=tiny_pairs[:4])
    pairs = tiny_pairs[:3]
    loss = trainer.compute_loss(model, PairSequenceCollator(tokenizer.pad_token_id)(pairs))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = 0
    for pair in pairs:
        rc = mean_logp(model, pair["prompt_ids"], pair["chosen_ids"])
        rr = mean_logp(model, pair["prompt_ids"], pair["rejected_ids"])
        want = want - torch.nn.functional.logsigmoid(rc - rr) / len(pairs)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-9)
    for name, parameter in model.named_parameters():
        assert torch.allclose(got[name], parameter.grad, atol=1e-9, rtol=0), name
    scorer = RewardModelScorer(model, tokenizer, head, name="model:lm", batch_size=2)
    rows = [("1+2=", "3"), ("4+4=", "8"), ("9+0=", "19")]
    scores = scorer(prompts=[p for p, _ in rows], completions=[c for _, c in rows], truncated=[False] * 3)
    with torch.no_grad():
        expected = []
        for prompt, completion in rows:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            expected.append(mean_logp(model, prompt_ids, completion_ids).item())
    assert scores == pytest.approx(expected, abs=1e-6)  # returned as float32
    with pytest.raises(ValueError, match="head 'classifier' scores with a …ForSequenceClassification model"):
        RewardTrainer(model=model, args=RewardConfig(output_dir=str(tmp_path), **QUIET_TRAINING))


def fed_sequences(model) -> list[list[int]]:
    """Every sequence ``model`` is run on from now on (its unpadded ``input_ids``), in order."""
    fed: list[list[int]] = []

    def record(module, args, kwargs):
        for ids, mask in zip(kwargs["input_ids"].tolist(), kwargs["attention_mask"].tolist()):
            fed.append([token for token, kept in zip(ids, mask) if kept])

    model.register_forward_pre_hook(record, with_kwargs=True)
    return fed


@pytest.mark.unit
def test_grpos_reward_model_scores_a_truncated_completion_without_eos_or_end_of_turn(tmp_path):
    """A completion cut at ``max_completion_length`` reaches the reward model as cut: no EOS (a string
    completion) and no end of turn (a conversational one), while a completion that stopped is scored
    with its stop token, as the reward model was trained. The fixture policy answers a prompt ending
    in a newline with ``42`` then the stop token, and any other prompt with ``x`` until the limit."""
    tokenizer = chat_tokenizer("chatml")
    four, two, x, eos, end_of_turn = tokenizer.convert_tokens_to_ids(["4", "2", "x", "<|endoftext|>", "<|im_end|>"])
    reward_lm = scripted_policy(tokenizer, ["4"])  # any causal LM of the vocabulary: what it is fed is checked
    fed = fed_sequences(reward_lm)

    def score(rows: list[dict], policy_ends: str, limit: int) -> None:
        prepared = truncate_rows(render_rows(rows, "grpo_prompts", tokenizer), Truncation(256, 128)).rows
        scorer = RewardModelScorer(reward_lm, tokenizer, "likelihood", name="model:rm")
        policy = scripted_policy(tokenizer, ["4", "2", policy_ends])
        trainer = pair_grpo(policy, tokenizer, prepared, [scorer], tmp_path / str(len(fed)), limit)
        trainer.generate_and_score(trainer.model, prepared)

    # string prompts: the first completion stops at EOS, the second is cut after 6 tokens
    score([{"prompt": "2+2?\n"}, {"prompt": "2+2="}], "<|endoftext|>", 6)
    assert fed == [tokenizer("2+2?\n").input_ids + [four, two, eos], tokenizer("2+2=").input_ids + [x] * 6]
    # conversational: the turn ends at <|im_end|> within 6 tokens, and is cut after 2
    fed.clear()
    conversation = [{"prompt": [{"role": "user", "content": "2+2?"}]}] * 2
    score(conversation, "<|im_end|>", 6)
    score(conversation, "<|im_end|>", 2)
    prompt = chat_prompt(tokenizer)
    assert fed == [prompt + [four, two, end_of_turn]] * 2 + [prompt + [four, two]] * 2


@pytest.mark.unit
def test_a_truncated_turn_whose_text_the_template_rewrites_is_refused_naming_it():
    tokenizer = chat_tokenizer("chatml")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    prompt, completion = [{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "four"}]
    assert render_completion(tokenizer, completion, prompt) == tokenizer("FOUR<|im_end|>").input_ids
    message = "the chat template does not render the completion's text as written ('four' is not in its render"
    with pytest.raises(TemplateError, match=re.escape(message)):
        render_completion(tokenizer, completion, prompt, ended=False)


@pytest.mark.slow
def test_training_separates_its_pairs_and_the_saved_model_scores_completions_as_it_trained(
    reward_start, tiny, tmp_path
):
    """From fresh weights, 60 steps on 16 pairs rank every pair's chosen answer first (accuracy on
    them from below 1 to 1); held-out accuracy from an SFT model is a benchmark (configs/rlhf.yaml)."""
    from trainers.data.rows import Truncation, tokenize_split
    from trainers.data.synthetic import AdditionTask, generate_addition

    _, tokenizer = tiny
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))["preference"][:16]
    pairs, dropped = tokenize_split(rows, "preference", tokenizer, Truncation(32, 16))
    assert dropped == 0
    torch.manual_seed(0)  # the fresh score head's weights: not those of whatever ran before in this process
    model, tokenizer, _ = load_reward_model(reward_start, head="classifier")
    args = RewardConfig(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=60,
        learning_rate=1e-2,
        per_device_train_batch_size=16,
        logging_steps=100,
        eval_strategy="epoch",
        **QUIET_TRAINING,
    )
    collator = PairSequenceCollator(tokenizer.pad_token_id)
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, eval_dataset=pairs, data_collator=collator)
    trainer.train()
    accuracy = [log["eval_accuracy"] for log in trainer.state.log_history if "eval_accuracy" in log]
    assert len(accuracy) == 60
    assert accuracy[0] < 1 and accuracy[-1] == 1.0
    trainer.save_model(str(tmp_path / "rm"))
    tokenizer.save_pretrained(str(tmp_path / "rm"))

    # the saved model, loaded as GRPO loads it, scores prompts and completions as the data has them,
    # tokenized as its training sequences were: the same scores
    model, tokenizer, head = load_reward_model(str(tmp_path / "rm"))
    assert head == "classifier" and saved_head(reward_start) == "likelihood"  # read off the architecture
    scorer = RewardModelScorer(model, tokenizer, head, name="model:rm", batch_size=3)
    prompts = [r["prompt"] for r in rows[:4]] * 2
    completions = [r["chosen"] for r in rows[:4]] + [r["rejected"] for r in rows[:4]]
    scores = scorer(prompts=prompts, completions=completions, truncated=[False] * 8, answer=[None] * 8)
    with torch.no_grad():
        want = [sequence_reward(trainer.model, p["prompt_ids"] + p["chosen_ids"]).item() for p in pairs[:4]]
        want += [sequence_reward(trainer.model, p["prompt_ids"] + p["rejected_ids"]).item() for p in pairs[:4]]
    assert scores == pytest.approx(want, abs=1e-5)
    assert all(c > r for c, r in zip(scores[:4], scores[4:]))


@pytest.mark.unit
def test_the_evaluation_reward_model_is_a_reward_stage_of_the_run_or_an_existing_source(tmp_path):
    config = load_config(
        None, ["stages=[sft, reward, grpo]", "grpo.reward_funcs=[model:reward]", "evaluation.reward_model=reward"]
    )
    assert config.evaluation.reward_model == "reward"
    refused = {
        "evaluation.reward_model: sft names a stage; it must be a reward stage": ["evaluation.reward_model=sft"],
        "evaluation.reward_model: reward names a stage": ["evaluation.reward_model=reward"],  # not among the stages
        "evaluation.reward_model: model folder .* does not exist": [f"evaluation.reward_model={tmp_path / 'gone'}"],
    }
    for message, overrides in refused.items():
        with pytest.raises(ValidationError, match=message):
            load_config(None, overrides)


@pytest.mark.unit
def test_the_reward_models_score_is_a_promotion_metric_only_with_an_evaluation_reward_model():
    """With ``evaluation.reward_model`` the gate may compare ``reward_model_score`` (its per-prompt
    values serve the paired test); without one, no evaluation produces it."""
    rlhf = ["stages=[sft, reward, grpo]", "grpo.reward_funcs=[model:reward]", "promotion.registered_model=m"]
    gated = ["promotion.metric=reward_model_score", "promotion.confidence=0.9"]
    config = load_config(None, [*rlhf, "evaluation.reward_model=reward", *gated])
    assert config.promotion.metric == "reward_model_score"
    with pytest.raises(ValidationError, match="promotion.metric: 'reward_model_score' is not a metric the evaluation"):
        load_config(None, [*rlhf, *gated])


@pytest.mark.unit
def test_the_evaluation_scores_each_models_samples_by_the_reward_model(reward_start, tiny, tiny_pairs):
    """``reward_model_score``: each prompt's mean score of its sampled token ids (stop token
    included), here the likelihood head's mean log-prob, computed per sample by hand; its CI and
    per-prompt values beside exact match."""
    from trainers.evaluation.evaluate import EvaluationSpec, GenerationSpec, RewardModelSource, evaluate_model

    model, tokenizer = tiny
    rows = [{"prompt_ids": p["prompt_ids"], "answer": "7"} for p in tiny_pairs[:5]]
    spec = EvaluationSpec(GenerationSpec(max_new_tokens=4, num_samples=3, batch_size=2), (1,), 50, 2, 4)
    scorer = RewardModelSource(reward_start, None, "float32").load("cpu")
    scores = evaluate_model(model, tokenizer, rows, None, spec, None, reward_model=scorer)
    plain = evaluate_model(model, tokenizer, rows, None, spec, None)
    assert "reward_model_score" not in plain.metrics
    assert {k: v for k, v in scores.metrics.items() if "reward_model" not in k} == plain.metrics  # the same samples

    from trainers.evaluation.evaluate import score_prompts

    results = score_prompts(model, tokenizer, rows, spec.generation)
    with torch.no_grad():
        want = [
            sum(mean_logp(scorer.model, list(r.prompt_ids), list(s.token_ids)).item() for s in r.samples) / 3
            for r in results
        ]
    assert scores.per_prompt["reward_model_score"] == pytest.approx(want, abs=1e-5)
    assert scores.metrics["reward_model_score"] == pytest.approx(sum(want) / 5, abs=1e-5)
    low, high = scores.metrics["reward_model_score_ci_low"], scores.metrics["reward_model_score_ci_high"]
    assert low <= scores.metrics["reward_model_score"] <= high and low < high


@pytest.mark.unit
def test_an_evaluation_of_several_models_loads_the_reward_model_once(reward_start, tiny, monkeypatch):
    """``evaluate_models``: one load of the reward model for every model, each model's scores those
    of its own evaluation with a scorer of its own (the reward model's scores included)."""
    import copy

    import trainers.evaluation.evaluate as evaluation
    from trainers.evaluation.evaluate import EvaluationSpec, GenerationSpec, RewardModelSource, evaluate_model

    model, tokenizer = tiny
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(0.5)  # other weights, other samples
    rows = [{"prompt_ids": [5, 6, 7], "answer": "7"}, {"prompt_ids": [8, 9], "answer": "3"}]
    spec = EvaluationSpec(GenerationSpec(max_new_tokens=4, num_samples=2, batch_size=2), (1,), 50, 2, 4)
    alone = [
        evaluate_model(
            m,
            tokenizer,
            rows,
            None,
            spec,
            None,
            reward_model=RewardModelSource(reward_start, None, "float32").load("cpu"),
        )
        for m in (model, other)
    ]
    loads = []
    load_scorer = evaluation.load_scorer
    monkeypatch.setattr(evaluation, "load_scorer", lambda *args: loads.append(args[0]) or load_scorer(*args))
    models = {"tiny": model, "other": other}
    scores = list(
        evaluation.evaluate_models(
            models,
            lambda name: (models[name], tokenizer, None),
            rows,
            spec,
            None,
            None,
            RewardModelSource(reward_start, None, "float32"),
        )
    )
    assert loads == [reward_start]
    assert scores == alone and scores[0] != scores[1]
    assert "reward_model_score" in scores[1].metrics


@pytest.mark.unit
def test_a_model_whose_tokenizer_the_reward_model_cannot_read_is_refused_before_it_is_scored(reward_start, tiny):
    """``evaluate_models`` checks each model's tokenizer against the reward model's before scoring
    it: a model with one token more (ids the scorer would misread) stops the evaluation with the
    reward model's path, after the models before it were scored."""
    import copy

    from trainers.evaluation.evaluate import EvaluationSpec, GenerationSpec, RewardModelSource, evaluate_models

    model, tokenizer = tiny
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<extra>"])
    tokenizers = {"same": tokenizer, "other": other}
    rows = [{"prompt_ids": [5, 6, 7], "answer": "7"}]
    spec = EvaluationSpec(GenerationSpec(max_new_tokens=2, num_samples=1, batch_size=1), (1,), 10, 0, 1)
    scored = evaluate_models(
        tokenizers,
        lambda name: (model, tokenizers[name], None),
        rows,
        spec,
        None,
        None,
        RewardModelSource(reward_start, None, "float32"),
    )
    assert "reward_model_score" in next(scored).metrics
    counts = f"{len(tokenizer)} vs {len(other)} tokens"  # the reward model's, the model's
    refusal = rf"^evaluation\.reward_model {re.escape(reward_start)} has another tokenizer \({counts}"
    with pytest.raises(ValueError, match=refusal):
        next(scored)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["classifier", "likelihood"])
def test_a_lora_reward_model_trains_its_adapters_and_head_and_is_saved_merged(reward_start, tiny_pairs, tmp_path, head):
    """With LoRA only the adapters (and a classifier's whole score head) train; the stage saves the
    merged model, which loads as a plain reward model of its head and scores as the adapted one did."""
    from trainers.models.lora import LoraSettings, add_adapters, save_stage_model, trainable_parameters

    base, tokenizer, _ = load_reward_model(reward_start, head=head)
    total = sum(p.numel() for p in base.parameters())
    model = add_adapters(base, LoraSettings(r=4, alpha=8), REWARD_HEADS.lookup(head).peft_task_type)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    args = RewardConfig(output_dir=str(tmp_path / "out"), head=head, max_steps=5, learning_rate=1e-2, **QUIET_TRAINING)
    collator = PairSequenceCollator(tokenizer.pad_token_id)
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=tiny_pairs[:16], data_collator=collator, processing_class=tokenizer
    )
    trainable = trainable_parameters(trainer.model)
    assert 0 < trainable < total / 10
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    batch = collator(tiny_pairs[:4])
    with torch.no_grad():
        adapted = REWARD_HEADS.lookup(head).score(trainer.model.eval(), batch)
    save_stage_model(trainer, tmp_path / "model", tmp_path / "adapter")
    merged, _, saved = load_reward_model(str(tmp_path / "model"))
    assert saved == head
    with torch.no_grad():
        assert torch.allclose(REWARD_HEADS.lookup(head).score(merged.eval(), batch), adapted, atol=1e-5)
