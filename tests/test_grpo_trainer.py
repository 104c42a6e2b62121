"""GRPOTrainer on the built-in tiny model: dataloader, generation buffer, dapo across steps,
masking, resume, metrics. Rewards come from real reward functions; nothing is mocked."""

import copy
import importlib.util
import math
import statistics

import datasets
import pytest
import torch
from policies import SHORT_GRPO, grpo_args
from transformers import TrainerCallback

from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.grpo.rewards import RewardError, allow_module
from trainers.grpo.samplers import RepeatSampler
from trainers.grpo.section import GRPOStageConfig
from trainers.grpo.trainer import COMPLETIONS_LOG_KEY, GRPOConfig, GRPOTrainer, completion_batch

pytestmark = pytest.mark.slow  # training: seconds a test


def code_point_sum(prompts, completions, **columns):
    """A reward that varies between samples of an untrained model, so advantages are not zero."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))["grpo_prompts"]
    tokenized, _ = tokenize_split(rows, "grpo_prompts", tokenizer, Truncation(32, 16))
    return tokenized


class RecordingTrainer(GRPOTrainer):
    """Counts generation calls and records which buffered slice each micro-step trains on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.served = 0, []

    def generate(self, model, prompts):
        self.calls += 1
        return super().generate(model, prompts)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        index = next(i for i, part in enumerate(self.buffer.slices) if part["input_ids"] is inputs["input_ids"])
        self.served.append((self.calls, index))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def make_trainer(tiny, prompts, tmp_path, **overrides):
    model, tokenizer = tiny
    args = grpo_args(tmp_path, **(SHORT_GRPO | overrides))
    return RecordingTrainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[code_point_sum],
    )


def test_dataloader_yields_each_generation_batch_for_every_step_of_its_cycle(tiny, prompts, tmp_path):
    trainer = make_trainer(tiny, prompts, tmp_path, steps_per_generation=3, num_iterations=2, seed=7)
    loader = trainer.get_train_dataloader()
    batches = [[row["prompt_ids"] for row in batch] for batch in loader]
    order = list(RepeatSampler(len(prompts), num_generations=2, prompts_per_chunk=6, repeats=6, seed=7))
    assert len(loader) == len(batches) == (len(prompts) // 6) * 6
    assert [len(b) for b in batches] == [12] * len(batches)  # per-device batch 4 × 3 steps
    assert batches == [[prompts[i]["prompt_ids"] for i in order[k * 12 : (k + 1) * 12]] for k in range(len(batches))]


@pytest.mark.parametrize(
    "steps_per_generation, accumulation, iterations, max_steps, expected_served",
    [
        # acceptance case: 6 optimizer steps × 2 / 4 = 3 generations, slices 0-3 once each
        (4, 2, 1, 6, [(g, k) for g in (1, 2, 3) for k in range(4)]),
        # μ = 2: each slice once per iteration, 4 micro-steps per generation
        (2, 2, 2, 4, [(g, k) for g in (1, 2) for k in (0, 1, 0, 1)]),
    ],
)
def test_generation_calls_and_slice_order(
    tiny, prompts, tmp_path, steps_per_generation, accumulation, iterations, max_steps, expected_served
):
    trainer = make_trainer(
        tiny,
        prompts,
        tmp_path,
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=accumulation,
        num_iterations=iterations,
        max_steps=max_steps,
    )
    trainer.train()
    assert trainer.state.global_step == max_steps
    assert trainer.calls == max_steps * accumulation // (steps_per_generation * iterations) == trainer.generation_calls
    assert trainer.served == expected_served
    assert all("old_logps" in part for part in trainer.buffer.slices)  # reused off-policy in both cases


class GradientRecorder(TrainerCallback):
    def __init__(self):
        self.gradients = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients.append([p.grad.detach().clone() for p in model.parameters()])


def test_dapo_with_more_steps_per_generation_than_accumulation_equals_the_big_batch(tiny, prompts, tmp_path):
    """steps_per_generation 4, accumulation 2: the generation batch spans 2 optimizer steps whose
    mean gradient is the gradient of the whole batch's loss Σ ℓ / N (learning rate 0 keeps the
    weights, so both steps see the same policy)."""
    trainer = make_trainer(
        tiny,
        prompts,
        tmp_path,
        per_device_train_batch_size=2,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        loss_type="dapo",
        optim="sgd",
        learning_rate=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
    )
    recorder = GradientRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert trainer.calls == 1 and len(recorder.gradients) == 2
    mean_gradient = [(a + b) / 2 for a, b in zip(*recorder.gradients)]

    # The big-batch loss, written out row by row on unpadded sequences: ℓ_t = −A·ρ_t with ρ = 1 at
    # these weights, normalised by N = counted completion tokens of all 8 rows.
    model = trainer.model
    model.zero_grad()
    rows = [
        (part["input_ids"][i], part["attention_mask"][i], part["completion_mask"][i], part["advantages"][i])
        for part in trainer.buffer.slices
        for i in range(len(part["input_ids"]))
    ]
    total_tokens = sum(int(mask.sum()) for _, _, mask, _ in rows)
    assert len(rows) == 8 and total_tokens > 0
    big_loss = 0.0
    for ids, attention, mask, advantage in rows:
        ids, mask = ids[attention.bool()], mask[attention.bool()]
        logprobs = (
            torch.log_softmax(model(ids.unsqueeze(0)).logits[0, :-1], -1).gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
        )
        ratio = torch.exp(logprobs - logprobs.detach())
        big_loss = big_loss + (-advantage * ratio * mask[1:]).sum() / total_tokens
    big_loss.backward()
    assert max(p.grad.abs().max().item() for p in model.parameters()) > 1e-4  # the test can fail
    for got, parameter in zip(mean_gradient, model.parameters()):
        assert torch.allclose(got, parameter.grad, atol=1e-6, rtol=1e-4)


def test_tokens_after_the_first_stop_token_count_for_nothing():
    eos, end_of_turn, pad = 2, 3, 0
    stop = (eos, end_of_turn)  # a chat model's turn ends at a token other than EOS (trainers/models/stop_tokens.py)
    prompts = [[10, 11], [12], [13]]
    generated = torch.tensor([[20, eos, 30, 31], [21, 22, 23, 24], [25, end_of_turn, 26, eos]])
    other_tail = torch.tensor([[20, eos, 40, eos], [21, 22, 23, 24], [25, end_of_turn, eos, 41]])
    batch, completions, truncated = completion_batch(prompts, generated, stop, pad, mask_truncated=False)
    same, _, _ = completion_batch(prompts, other_tail, stop, pad, mask_truncated=False)
    assert completions == [[20, eos], [21, 22, 23, 24], [25, end_of_turn]] and truncated == [False, True, False]
    assert all(torch.equal(batch[k], same[k]) for k in batch)
    assert batch["input_ids"].tolist() == [
        [10, 11, 20, eos, pad],
        [12, 21, 22, 23, 24],
        [13, 25, end_of_turn, pad, pad],
    ]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    masked, _, _ = completion_batch(prompts, generated, stop, pad, mask_truncated=True)
    assert masked["completion_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    only_eos, _, cut = completion_batch(prompts, generated, (eos,), pad, mask_truncated=False)
    assert cut == [False, True, False] and only_eos["input_ids"][2].tolist() == [13, 25, end_of_turn, 26, eos]


def test_all_truncated_and_masked_gives_zero_loss_and_unchanged_parameters(tiny, prompts, tmp_path):
    # seed 1: no completion samples EOS within 2 tokens (the premise, asserted below)
    trainer = make_trainer(
        tiny, prompts, tmp_path, max_completion_length=2, mask_truncated_completions=True, max_steps=3, seed=1
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    step_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["completions/clipped_ratio"] for log in step_logs] == [1.0] * 3  # nothing ended with EOS in 2 tokens
    assert all(log["rewards/code_point_sum/std"] > 0 for log in step_logs)  # advantages were not all zero
    assert [log["loss"] for log in step_logs] == [0.0] * 3
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))


def test_resume_from_a_checkpoint_regenerates_the_empty_buffer(tiny, prompts, tmp_path):
    settings = dict(steps_per_generation=4, max_steps=4, save_strategy="steps", save_steps=2)
    first = make_trainer(tiny, prompts, tmp_path, **settings)
    first.train()
    assert first.calls == 1  # one generation batch serves all 4 steps
    resumed = make_trainer(tiny, prompts, tmp_path, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4 and len(resumed.served) == 2
    assert resumed.calls == 1 and resumed.served[0] == (1, 0)  # regenerated, then served from the start


def test_metrics_kl_reference_and_sample_table(tiny, prompts, tmp_path):
    model, tokenizer = tiny
    allow_module("tests.test_grpo_trainer")  # as a config's `plugins` would: import paths need an allowed module
    args = grpo_args(
        tmp_path,
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        learning_rate=1e-2,
        logging_steps=1,
        max_steps=2,
        beta=0.5,
        reward_funcs=["tests.test_grpo_trainer:code_point_sum", "format"],
        reward_weights=[1.0, 2.0],
        log_completions_steps=2,
        num_completions_to_log=3,
    )
    trainer = RecordingTrainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
    )
    reference_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    first, second = [log for log in trainer.state.log_history if "loss" in log]
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "entropy",
        "time/generation_per_step",
        "time/training_per_step",
        "rewards/tests.test_grpo_trainer:code_point_sum/mean",
        "rewards/format/std",
    ):
        assert key in first, key
    name = "tests.test_grpo_trainer:code_point_sum"
    assert first["reward"] == pytest.approx(first[f"rewards/{name}/mean"] + 2 * first["rewards/format/mean"], abs=1e-5)
    assert first["kl"] == 0.0 and second["kl"] > 0.0  # the policy moved away from its frozen start
    assert all(torch.equal(p, b) for p, b in zip(trainer.ref_model.parameters(), reference_before))
    assert 3.0 < first["entropy"] < 5.0  # an untrained model is near-uniform over ~100 tokens
    assert COMPLETIONS_LOG_KEY not in first
    table = second[COMPLETIONS_LOG_KEY]
    assert set(table) == {"step", "prompt", "completion", "reward", f"rewards/{name}", "rewards/format"}
    assert table["step"] == [2, 2, 2] and all(p.endswith("=") for p in table["prompt"])
    assert table["reward"] == pytest.approx(
        [a + 2 * b for a, b in zip(table[f"rewards/{name}"], table["rewards/format"])]
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_completions_no_reward_scored_are_left_out_of_the_group_baseline(tiny, prompts, tmp_path, estimator):
    """A ``None`` reward (e.g. ``correctness`` on a row without an answer) is missing: the group's
    mean and standard deviation (GRPO), or the other completions' mean (RLOO, unscaled), come from
    the scored completions, and its advantage is 0."""
    returned = []

    def every_fourth_unscored(prompts, completions, **columns):
        values = [None if i % 4 == 1 else float(sum(map(ord, c)) % 7) for i, c in enumerate(completions)]
        returned.extend(values)
        return values

    model, tokenizer = tiny
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        args=grpo_args(
            tmp_path,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=4,
            advantage_estimator=estimator,
            scale_rewards="group" if estimator == "grpo" else "none",
        ),
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[every_fourth_unscored],
    )
    rows = [prompts[0]] * 4 + [prompts[1]] * 4
    (batch,) = trainer.generate_and_score(trainer.model, rows)
    expected = []
    for group in (returned[:4], returned[4:]):
        scored = [r for r in group if r is not None]
        if estimator == "grpo":
            mean, spread = statistics.mean(scored), statistics.stdev(scored) + 1e-4
            expected += [0.0 if r is None else (r - mean) / spread for r in group]
        else:
            expected += [0.0 if r is None else r - (sum(scored) - r) / (len(scored) - 1) for r in group]
    assert batch["advantages"].tolist() == pytest.approx(expected, abs=1e-5)
    assert batch["advantages"][[1, 5]].tolist() == [0.0, 0.0]
    assert trainer.window["frac_reward_missing"] == [0.25]
    assert trainer.window["reward"] == [pytest.approx(statistics.mean(r for r in returned if r is not None))]


def test_a_generation_batch_no_reward_scored_fails_the_stage_naming_the_step_and_rewards(tiny, prompts, tmp_path):
    """Every reward None (or nan) leaves every advantage 0 and a loss of 0: nothing is learnt, and
    the run must not look like one that trained."""

    def never_applies(prompts, completions, **columns):
        return [None] * len(completions)

    model, tokenizer = tiny
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        args=grpo_args(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=4),
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[never_applies],
    )
    message = "no reward function scored any of the 4 completions of the generation batch at step 0: never_applies"
    with pytest.raises(RewardError, match=message):
        trainer.train()


def test_config_errors_are_clear(tmp_path):
    common = dict(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="not both"):
        GRPOConfig(**common, num_generations=2, steps_per_generation=2, generation_batch_size=8)
    with pytest.raises(ValueError, match=r"\(4 × 1 = 4\) must be divisible by num_generations \(8\)"):
        GRPOConfig(**common, num_generations=8)
    section = dict(per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(ValueError, match="unknown scale_rewards 'mad'"):
        GRPOStageConfig(**section, scale_rewards="mad")
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        GRPOStageConfig(**section, loss_type="ppo")
    with pytest.raises(ValueError, match="reward_weights has 2 values for 1 reward_funcs"):
        GRPOStageConfig(**section, reward_weights=[1.0, 2.0])
    args = GRPOConfig(**common, num_generations=2, generation_batch_size=12, gradient_accumulation_steps=3)
    assert (args.steps_per_generation, args.layout.steps_per_generation, args.reuses_generations) == (None, 3, False)
    assert GRPOConfig(**common, num_generations=2, num_iterations=2).reuses_generations
    assert (args.epsilon_high, args.upper_epsilon) == (None, args.epsilon)


def constant_reward(prompts, completions, **columns):
    """Every completion gets the same reward: all advantages are 0."""
    return [1.0] * len(completions)


def sequence_logp(model, ids: list[int], completion_positions: list[int]) -> float:
    """Σ_t log p(x_t | x_<t) over ``completion_positions`` of one unpadded row (plain log_softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return sum(torch.log_softmax(logits[t - 1], -1)[ids[t]].item() for t in completion_positions)


@pytest.mark.parametrize("normalize", [False, True])
def test_the_kl_in_the_reward_lowers_each_reward_by_beta_times_its_sequence_kl(tiny, prompts, tmp_path, normalize):
    """``use_kl_in_reward`` (TRL's RLOO): r_i − β Σ_t (log π_old − log π_ref) before RLOO's baseline,
    from per-row forwards of the policy and of a reference that differs from it; the slices keep no
    reference log-probs (the loss has no KL term) and, on-policy, no π_old. ``normalize_advantages``
    then standardises the advantages over the batch."""
    returned = []

    def digit_count(prompts, completions, **columns):
        values = [float(sum(ch.isdigit() for ch in c)) for c in completions]
        returned.extend(values)
        return values

    model, tokenizer = tiny
    reference = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        ref_model=reference,
        args=grpo_args(
            tmp_path,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=4,
            beta=0.5,
            use_kl_in_reward=True,
            advantage_estimator="rloo",
            scale_rewards="none",
            normalize_advantages=normalize,
        ),
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[digit_count],
    )
    (batch,) = trainer.generate_and_score(trainer.model, [prompts[0]] * 4 + [prompts[1]] * 4)
    assert "ref_logps" not in batch and "old_logps" not in batch
    kl = []
    for ids, attention, completion in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"]):
        row = ids[attention.bool()].tolist()
        positions = completion.nonzero().flatten().tolist()
        kl.append(sequence_logp(trainer.model, row, positions) - sequence_logp(reference, row, positions))
    penalized = [r - 0.5 * k for r, k in zip(returned, kl)]
    expected = []
    for group in (penalized[:4], penalized[4:]):
        expected += [r - (sum(group) - r) / 3 for r in group]
    if normalize:
        mean, spread = statistics.mean(expected), statistics.stdev(expected) + 1e-4
        expected = [(a - mean) / spread for a in expected]
    assert min(abs(k) for k in kl) > 1e-3  # the reference differs: every row pays a KL
    assert batch["advantages"].tolist() == pytest.approx(expected, abs=1e-4)
    assert trainer.window["reward_kl"] == [pytest.approx(statistics.mean(kl), abs=1e-5)]
    assert trainer.window["reward"] == [pytest.approx(statistics.mean(returned))]  # the task's reward, as scored


def test_the_kl_in_the_reward_needs_a_coefficient_and_no_loss_side_correction():
    with pytest.raises(ValueError, match="use_kl_in_reward needs beta > 0"):
        GRPOStageConfig(use_kl_in_reward=True)
    with pytest.raises(ValueError, match="with use_kl_in_reward the loss has none"):
        GRPOStageConfig(use_kl_in_reward=True, beta=0.1, use_bias_correction_kl=True)


OBJECTIVE_OPTIONS = {
    "gspo": dict(importance_sampling_level="sequence"),
    "gspo_wide": dict(importance_sampling_level="sequence", sequence_epsilon=0.2, sequence_epsilon_high=0.3),
    "gspo_luspo": dict(importance_sampling_level="sequence", loss_type="luspo"),
    "cispo": dict(policy_loss="cispo", cispo_max_ratio=2.0),
    "sapo": dict(policy_loss="sapo"),
    "delta": dict(delta=1.5),
    "bias_corrected_kl": dict(use_bias_correction_kl=True),
    "entropy_bonus": dict(entropy_coef=0.01),
    "top_entropy_quantile": dict(top_entropy_quantile=0.2),
    "rloo": dict(advantage_estimator="rloo", scale_rewards="none"),
    "rloo_kl_in_reward": dict(
        advantage_estimator="rloo", scale_rewards="none", use_kl_in_reward=True, normalize_advantages=True
    ),
}


@pytest.mark.parametrize("option", sorted(OBJECTIVE_OPTIONS))
def test_a_short_run_per_objective_and_option_trains_the_policy_and_not_the_reference(tiny, prompts, tmp_path, option):
    """Two optimizer steps of two micro-steps each over one generation batch reused twice
    (num_iterations 2: ratios move away from 1), with β > 0 so a reference model is loaded."""
    trainer = make_trainer(
        tiny,
        prompts,
        tmp_path,
        beta=0.1,
        num_iterations=2,
        steps_per_generation=2,
        max_steps=2,
        **OBJECTIVE_OPTIONS[option],
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    reference_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    if trainer.args.use_kl_in_reward:  # one generation batch, sampled by the reference itself: no KL to pay
        assert "kl" not in logs[0] and logs[0]["reward_kl"] == 0.0
    else:  # the first step's policy is the reference (k3 of equal log-probs is exactly 0); it moved after it
        assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0.0
    assert any(not torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
    assert all(torch.equal(p, b) for p, b in zip(trainer.ref_model.parameters(), reference_before))
    assert ("clip_ratio/low_mean" in logs[0]) == (trainer.objective.name == "clip")
    assert ("cispo/capped_fraction" in logs[0]) == (trainer.objective.name == "cispo")
    if option == "top_entropy_quantile":
        assert all(0.0 < log["entropy_mask/kept_fraction"] <= 0.5 for log in logs)


@pytest.mark.parametrize("entropy_coef, moves", [(0.0, False), (0.05, True)])
def test_the_entropy_bonus_alone_moves_the_policy(tiny, prompts, tmp_path, entropy_coef, moves):
    """With equal rewards every advantage is 0 and β = 0: the policy term has no gradient, so the
    parameters move exactly when the entropy bonus is on."""
    model, tokenizer = tiny
    args = grpo_args(
        tmp_path,
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-2,
        max_steps=2,
        optim="sgd",
        entropy_coef=entropy_coef,
    )
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[constant_reward],
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    moved = any(not torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
    assert moved == moves


def test_objective_options_are_checked_when_the_arguments_are_built(tmp_path):
    common = dict(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(
        ValueError, match="policy_loss 'cispo' at importance_sampling_level 'token' needs cispo_max_ratio"
    ):
        GRPOConfig(**common, policy_loss="cispo")
    with pytest.raises(ValueError, match="epsilon_high: 0.28 has no effect with policy_loss 'clip' at importance_"):
        GRPOConfig(**common, importance_sampling_level="sequence", epsilon_high=0.28)
    with pytest.raises(ValueError, match=r"delta \(1.2\) must exceed 1 \+ epsilon_high \(1.28\)"):
        GRPOConfig(**common, epsilon_high=0.28, delta=1.2)
    with pytest.raises(ValueError, match="use_bias_correction_kl needs beta > 0"):
        GRPOConfig(**common, use_bias_correction_kl=True)
    gspo = GRPOConfig(**common, importance_sampling_level="sequence")
    assert gspo.clip_range == (3e-4, 4e-4) and GRPOConfig(**common).clip_range == (0.2, 0.2)
    section = GRPOStageConfig(per_device_train_batch_size=4, num_generations=2, policy_loss="sapo")
    assert (
        section.training_arguments(GRPOConfig, output_dir=str(tmp_path)).objective_params.sapo_temperature_neg == 1.05
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this environment has vLLM")
def test_vllm_generation_needs_vllm_in_the_trainers_environment_only_when_colocated(tiny, prompts, tmp_path):
    """Colocated, the trainer's process runs the engine; with a server it only talks to one, and
    refuses to start without its address (the pipeline's train task gives it one it started)."""
    vllm = dict(generation_backend="vllm")
    with pytest.raises(ModuleNotFoundError, match="generation_backend vllm: vLLM is not installed"):
        make_trainer(tiny, prompts, tmp_path, **vllm)
    with pytest.raises(ValueError, match="vllm_mode server: vllm_server_url names no server"):
        make_trainer(tiny, prompts, tmp_path, **vllm, vllm_mode="server")
    trainer = make_trainer(tiny, prompts, tmp_path, **vllm, vllm_mode="server", vllm_server_url="http://gen:8100")
    assert trainer.backend.engine is None  # built at the first generation


def test_a_completion_that_would_pass_the_models_context_is_refused_before_the_first_step(tiny, prompts, tmp_path):
    longest, context = max(len(p["prompt_ids"]) for p in prompts), tiny[0].config.max_position_embeddings
    assert (longest, context) == (4, 128)
    with pytest.raises(ValueError) as error:
        make_trainer(tiny, prompts, tmp_path, max_completion_length=125)
    assert str(error.value) == (
        "grpo: the longest prompt (4 tokens) + grpo.max_completion_length (125) is 129 tokens, beyond the model's "
        "context (128 positions): set grpo.max_completion_length to at most 124, or cut the prompts shorter "
        "(data.max_prompt_length or grpo.max_prompt_length)"
    )
    assert make_trainer(tiny, prompts, tmp_path, max_completion_length=124).calls == 0  # exactly the context
    assert make_trainer(tiny, prompts, tmp_path, max_prompt_length=2, max_completion_length=126).calls == 0
    with pytest.raises(ValueError, match=r"is 65 tokens, beyond grpo.vllm_max_model_len \(64 positions\): set "):
        make_trainer(
            tiny, prompts, tmp_path, generation_backend="vllm", vllm_max_model_len=64, max_completion_length=61
        )


def test_the_mismatch_correction_and_the_off_policy_mask_weight_the_trainers_loss(tiny, prompts, tmp_path):
    """A slice as a vLLM run gives it: the engine's log-probs ``π_old − log 2`` at every token, so every
    token's ratio π_old / π_vllm is 2. ``token_truncate`` (cap 3) doubles the
    loss, ``token_mask`` at a cap of 1.5 drops every token, ``sequence_mask`` keeps the completions
    whose ratio is under the cap, at their ratio's weight; the off-policy mask drops the completions with negative
    advantages once π has drifted from π_old. The options are set on the built arguments: an hf trainer
    refuses vllm options."""
    trainer = make_trainer(tiny, prompts, tmp_path, max_steps=1)
    (first, *_) = trainer.generate_and_score(trainer.model, next(iter(trainer.get_train_dataloader())))
    old = torch.full(first["input_ids"].shape, -4.0)[:, 1:]  # π_old, which π (log π > −4 mostly) drifted from
    engine = torch.cat([torch.zeros_like(old[:, :1]), old - math.log(2.0)], 1)
    inputs = first | {"old_logps": old}

    def loss(batch: dict, **options) -> float:
        for name, value in options.items():
            setattr(trainer.args, name, value)
        try:
            return GRPOTrainer.compute_loss(trainer, trainer.model, dict(batch)).item()  # not the recording one
        finally:
            for name in options:
                setattr(trainer.args, name, GRPOStageConfig.model_fields[name].default)

    plain, served = loss(inputs), inputs | {"engine_logps": engine}
    assert plain != 0.0 and loss(served) == plain  # the engine's log-probs alone change nothing
    assert loss(served, vllm_importance_sampling_cap=3.0) == pytest.approx(2 * plain, rel=1e-6)
    assert loss(served, vllm_importance_sampling_cap=1.5, vllm_importance_sampling_mode="token_mask") == 0.0
    # per completion, by the sum of its tokens' gaps g: one gap per completion, e^(g·|y|) against a cap of 3
    lengths = first["completion_mask"][:, 1:].sum(-1).to(old.dtype)
    gaps = torch.linspace(0.1, 1.0, len(lengths))
    ratios = torch.exp(gaps * lengths)
    assert (ratios <= 3).any() and (ratios > 3).any()
    by_row = torch.cat([torch.zeros_like(old[:, :1]), old - gaps[:, None]], 1)
    sequence_mask = {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_cap": 3.0}
    # a weight w ≥ 0 of a completion's loss is its advantage times w (the objective is homogeneous in A)
    weighted = inputs | {"advantages": inputs["advantages"] * torch.where(ratios <= 3, ratios, 0.0)}
    assert loss(inputs | {"engine_logps": by_row}, **sequence_mask) == pytest.approx(loss(weighted), rel=1e-6)
    negative = inputs | {"advantages": -inputs["advantages"].abs() - 0.1}
    positive = inputs | {"advantages": inputs["advantages"].abs() + 0.1}
    assert loss(negative, off_policy_mask_threshold=0.5) == 0.0 != loss(negative)
    assert loss(positive, off_policy_mask_threshold=0.5) == loss(positive) != 0.0


def test_each_step_logs_how_many_versions_old_the_policy_that_sampled_its_slice_is(tiny, prompts, tmp_path):
    """One generation batch of 3 slices, each trained on twice (``num_iterations`` 2), all sampled by
    the policy of version 0 (no step taken): the slice trained at step s was sampled s optimizer steps
    before. The next batch is sampled at step 6 and trained from it."""
    trainer = make_trainer(tiny, prompts, tmp_path, steps_per_generation=3, num_iterations=2, max_steps=8)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["staleness/steps_max"] for log in logs] == [0, 1, 2, 3, 4, 5, 0, 1]
    assert [log["staleness/steps_mean"] for log in logs] == [0, 1, 2, 3, 4, 5, 0, 1]
