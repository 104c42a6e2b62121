"""On-policy distillation (GKD): the generalized JSD against its formula written here (float64,
value and gradient), the on-policy draws, the collator, the config checks, and the trainer's loss
and sampling against per-sequence formulas on the tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import QUIET_TRAINING
from pydantic import ValidationError

from infra.core.config import load_config
from trainers.catalog import STAGES
from trainers.distill.trainer import (
    DistillConfig,
    DistillTrainer,
    PromptCompletionCollator,
    draws_on_policy,
    generalized_jsd,
)
from trainers.grpo.stage import reward_functions
from trainers.models.devices import placed_on
from trainers.models.pretrained import check_same_vocabulary


def written_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, tau: float) -> torch.Tensor:
    """GKD's JSD_β per row, from the paper's definition, with softmax as exp / Σ exp (no log_softmax)."""
    s = torch.exp(student / tau) / torch.exp(student / tau).sum(-1, keepdim=True)
    t = torch.exp(teacher / tau) / torch.exp(teacher / tau).sum(-1, keepdim=True)
    if beta == 0:
        return (t * torch.log(t / s)).sum(-1)
    if beta == 1:
        return (s * torch.log(s / t)).sum(-1)
    m = beta * t + (1 - beta) * s
    return beta * (t * torch.log(t / m)).sum(-1) + (1 - beta) * (s * torch.log(s / m)).sum(-1)


@pytest.mark.unit
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_the_generalized_jsd_matches_its_definition_in_float64_with_its_gradient(beta, tau):
    generator = torch.Generator().manual_seed(0)
    student = (2 * torch.randn(5, 7, generator=generator, dtype=torch.float64)).requires_grad_()
    teacher = 2 * torch.randn(5, 7, generator=generator, dtype=torch.float64)
    got = generalized_jsd(student, teacher, beta, tau)
    assert got.dtype == torch.float64
    (grad,) = torch.autograd.grad(got.sum(), student)
    want_student = student.detach().clone().requires_grad_()
    want = written_jsd(want_student, teacher, beta, tau)
    (want_grad,) = torch.autograd.grad(want.sum(), want_student)
    assert torch.allclose(got, want, atol=1e-10, rtol=0)
    assert torch.allclose(grad, want_grad, atol=1e-10, rtol=0)
    assert (got > 0).all()


@pytest.mark.unit
def test_forward_kls_gradient_is_the_softmax_difference_over_tau_and_equal_distributions_cost_nothing():
    """d KL(T ‖ S) / d z_S = (S − T) / τ."""
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(3, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad(generalized_jsd(student, teacher, 0.0, 0.5).sum(), student)
    want = (torch.softmax(student.detach() / 0.5, -1) - torch.softmax(teacher / 0.5, -1)) / 0.5
    assert torch.allclose(grad, want, atol=1e-12, rtol=0)
    for beta in (0.0, 0.5, 1.0):
        assert generalized_jsd(teacher, teacher, beta).abs().max().item() < 1e-12
    # JSD_β is bounded by the mixture's entropy terms: at most −β log β − (1 − β) log(1 − β)
    far = torch.tensor([[50.0, 0.0]], dtype=torch.float64)
    assert generalized_jsd(far, far.flip(-1), 0.5).item() == pytest.approx(math.log(2), abs=1e-12)


@pytest.mark.unit
def test_on_policy_draws_are_a_function_of_seed_and_step_with_frequency_lambda():
    draws = [draws_on_policy(0, step, 0, 0.3) for step in range(10_000)]
    assert sum(draws) == 3018  # fixed by the seed: ≈ λ · 10,000
    assert draws[:8] == [draws_on_policy(0, step, 0, 0.3) for step in range(8)]  # the same again
    assert [draws_on_policy(0, step, 0, 0.5) for step in range(6)] == [True, True, False, True, True, False]
    assert [draws_on_policy(1, step, 0, 0.5) for step in range(6)] != [True, True, False, True, True, False]
    assert not any(draws_on_policy(0, step, 1, 0.0) for step in range(100))
    assert all(draws_on_policy(0, step, 1, 1.0) for step in range(100))


@pytest.mark.unit
def test_the_collator_keeps_the_prompts_left_padded_beside_the_rows():
    batch = PromptCompletionCollator(pad_token_id=0)(
        [{"prompt_ids": [5, 6], "completion_ids": [7]}, {"prompt_ids": [8], "completion_ids": [9, 10, 11]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert batch["prompt_ids"].tolist() == [[5, 6], [0, 8]]
    assert batch["prompt_mask"].tolist() == [[1, 1], [0, 1]]


@pytest.mark.unit
def test_a_distill_stage_needs_an_existing_teacher_at_load_time(tmp_path):
    with pytest.raises(ValidationError, match="teacher_model: the stage distils from a teacher"):
        load_config(None, ["stages=[sft, distill]"])
    with pytest.raises(ValidationError, match="distill.teacher_model: model folder .* does not exist"):
        load_config(None, ["stages=[sft, distill]", f"distill.teacher_model={tmp_path / 'gone'}"])
    config = load_config(None, ["stages=[sft, distill]", "distill.teacher_model=builtin:llama-20m"])
    assert (config.distill.lmbda, config.distill.beta, config.distill.temperature) == (0.5, 0.5, 0.9)


@pytest.mark.unit
def test_a_helper_models_gpu_of_its_own_is_refused_over_several_processes_and_where_it_is_missing():
    """A teacher (or GRPO's reward model) on a GPU of its own serves one process: over several, every
    process would load a copy on it (a config error at load time); ``cpu`` and ``policy`` load."""
    teacher = ["stages=[sft, distill]", "distill.teacher_model=builtin:llama-20m", "compute.num_processes=2"]
    with pytest.raises(
        ValidationError, match="distill: teacher_device: cuda:1 with compute.num_processes 2: every process would"
    ):
        load_config(None, [*teacher, "distill.teacher_device=cuda:1"])
    assert load_config(None, [*teacher, "distill.teacher_device=cpu"]).distill.teacher_device == "cpu"
    assert load_config(None, teacher).distill.teacher_device == "policy"
    with pytest.raises(ValidationError, match="grpo: reward_model_device: cuda with compute.num_processes 2"):
        load_config(None, ["stages=[sft, grpo]", "grpo.reward_model_device=cuda", "compute.num_processes=2"])
    with pytest.raises(ValidationError, match="grpo.reward_model_device"):
        load_config(None, ["grpo.reward_model_device=gpu0"])
    assert placed_on("policy", "cpu", "distill.teacher_device") == torch.device("cpu")
    assert placed_on("cpu", "cpu", "distill.teacher_device") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"distill.teacher_device: cuda:64, but this machine has \d+ CUDA device"):
        placed_on("cuda:64", "cpu", "distill.teacher_device")
    # GRPO with reward functions only loads no reward model: its device is not asked for
    section = STAGES["grpo"].section(reward_funcs=["correctness"], reward_model_device="cuda:64")
    assert reward_functions(section, None, "cpu") == ["correctness"]
    with pytest.raises(ValueError, match=r"grpo.reward_model_device: cuda:64, but this machine has \d+ CUDA"):
        reward_functions(section.model_copy(update={"reward_funcs": ["model:reward"]}), None, "cpu")


@pytest.mark.unit
def test_a_teacher_with_another_vocabulary_is_refused(tiny):
    _, tokenizer = tiny
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<extra>"])
    check_same_vocabulary(tokenizer, copy.deepcopy(tokenizer), "the teacher same", "why")
    with pytest.raises(ValueError, match=r"the teacher elsewhere has another tokenizer \(104 vs 103 tokens"):
        check_same_vocabulary(tokenizer, other, "the teacher elsewhere", "why")


def perturbed(model, scale: float, seed: int):
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for parameter in copy_.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return copy_


def make_trainer(student, teacher, tokenizer, rows, tmp_path, **settings):
    settings = dict(per_device_train_batch_size=4, learning_rate=1e-3, max_new_tokens=6) | settings
    return DistillTrainer(
        model=student,
        teacher_model=teacher,
        args=DistillConfig(output_dir=str(tmp_path), **QUIET_TRAINING, **settings),
        train_dataset=rows,
        data_collator=PromptCompletionCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )


@pytest.fixture(scope="module")
def demonstrations(tiny_pairs) -> list[dict]:
    return [{"prompt_ids": p["prompt_ids"], "completion_ids": p["chosen_ids"]} for p in tiny_pairs[:16]]


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_the_trainers_loss_and_gradient_equal_the_per_sequence_formula_in_float64(tiny, demonstrations, tmp_path, beta):
    model, tokenizer = tiny
    student, teacher = copy.deepcopy(model).double().eval(), perturbed(model, 0.05, 0).double().eval()
    trainer = make_trainer(student, teacher, tokenizer, demonstrations, tmp_path, beta=beta, temperature=0.8)
    rows = demonstrations[:3]
    loss = trainer.compute_loss(student, PromptCompletionCollator(tokenizer.pad_token_id)(rows))
    loss.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    terms = []
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
        positions = slice(len(row["prompt_ids"]) - 1, ids.shape[1] - 1)  # those predicting a completion token
        with torch.no_grad():
            teacher_logits = teacher(ids).logits[0, positions]
        terms.append(written_jsd(student(ids).logits[0, positions], teacher_logits, beta, 0.8))
    want = torch.cat(terms).mean()
    want.backward()
    assert loss.dtype == torch.float64 and want.item() > 1e-4
    assert loss.item() == pytest.approx(want.item(), abs=1e-9)
    for name, parameter in student.named_parameters():
        assert torch.allclose(got[name], parameter.grad, atol=1e-9, rtol=0), name


@pytest.mark.slow
def test_the_student_samples_its_own_completions_after_each_prompt_and_the_same_again_under_a_seed(
    tiny, demonstrations, tmp_path
):
    model, tokenizer = tiny
    trainer = make_trainer(copy.deepcopy(model), perturbed(model, 0.05, 0), tokenizer, demonstrations, tmp_path)
    inputs = PromptCompletionCollator(tokenizer.pad_token_id)(demonstrations[:4])
    first, again = trainer.sampled_batch(trainer.model, inputs, 7), trainer.sampled_batch(trainer.model, inputs, 7)
    other = trainer.sampled_batch(trainer.model, inputs, 8)
    assert all(torch.equal(first[k], again[k]) for k in first) and not torch.equal(
        first["input_ids"], other["input_ids"]
    )
    for row, (ids, mask) in enumerate(zip(first["input_ids"], first["completion_mask"])):
        prompt = demonstrations[row]["prompt_ids"]
        assert ids[: len(prompt)].tolist() == prompt and mask[: len(prompt)].sum() == 0
        completion = ids[mask.bool()].tolist()
        assert 1 <= len(completion) <= 6  # max_new_tokens
        ends = [i for i, token in enumerate(completion) if token in trainer.stop_ids]
        assert ends in ([], [len(completion) - 1])  # cut at its first stop token, if it sampled one


@pytest.mark.slow
def test_with_seq_kd_the_off_policy_steps_train_on_the_teachers_samples_under_the_steps_seed(
    tiny, demonstrations, tmp_path
):
    """λ = 0 with ``seq_kd`` (sequence-level KD): each step's batch is the batch's prompts with the
    teacher's samples under the step's seed (what a trainer whose student is the teacher samples
    under that seed), not the data's completions."""
    from trainers.distill.trainer import derived_seed

    model, tokenizer = tiny
    teacher = perturbed(model, 0.05, 0)
    trainer = make_trainer(
        copy.deepcopy(model), teacher, tokenizer, demonstrations, tmp_path, lmbda=0.0, seq_kd=True, max_steps=2
    )
    as_student = make_trainer(copy.deepcopy(teacher), teacher, tokenizer, demonstrations, tmp_path / "t")
    inputs = PromptCompletionCollator(tokenizer.pad_token_id)(demonstrations[:4])
    by_teacher = trainer.teacher_batch(inputs, 7)
    assert all(torch.equal(by_teacher[k], as_student.sampled_batch(as_student.model, inputs, 7)[k]) for k in by_teacher)
    assert not torch.equal(by_teacher["input_ids"], trainer.sampled_batch(trainer.model, inputs, 7)["input_ids"])

    seen, compute_loss = [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append({name: tensor.clone() for name, tensor in inputs.items()})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    by_prompt = {tuple(row["prompt_ids"]): row for row in demonstrations}
    assert len(seen) == 2
    for step, batch in enumerate(seen):
        lengths = (batch["attention_mask"].sum(1) - batch["completion_mask"].sum(1)).tolist()  # right-padded
        prompts = [ids[:length] for ids, length in zip(batch["input_ids"], lengths)]
        rows = [by_prompt[tuple(prompt.tolist())] for prompt in prompts]
        want = trainer.teacher_batch(
            PromptCompletionCollator(tokenizer.pad_token_id)(rows), derived_seed(trainer.args.seed, "teacher", step, 0)
        )
        assert torch.equal(batch["input_ids"], want["input_ids"]) and torch.equal(
            batch["completion_mask"], want["completion_mask"]
        )
        data = PromptCompletionCollator(tokenizer.pad_token_id)(rows)
        assert batch["input_ids"].shape != data["input_ids"].shape or not torch.equal(
            batch["input_ids"], data["input_ids"]
        )


@pytest.mark.slow
@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_training_moves_the_student_towards_a_frozen_teacher(tiny, demonstrations, tmp_path, lmbda):
    model, tokenizer = tiny
    teacher = perturbed(model, 0.05, 0)
    before = [p.detach().clone() for p in teacher.parameters()]
    trainer = make_trainer(
        copy.deepcopy(model),
        teacher,
        tokenizer,
        demonstrations,
        tmp_path,
        lmbda=lmbda,
        max_steps=24,
        logging_steps=8,
        lr_scheduler_type="constant",
    )
    inputs = PromptCompletionCollator(tokenizer.pad_token_id)(demonstrations)
    with torch.no_grad():
        start = trainer.compute_loss(trainer.model.eval(), inputs).item()
    trainer.train()
    with torch.no_grad():
        end = trainer.compute_loss(trainer.model.eval(), inputs).item()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["on_policy"] for log in logs] == [lmbda] * 3
    assert {"completion_length", "logps/student", "logps/teacher", "num_tokens"} <= set(logs[0])
    assert set(STAGES["distill"].curves) <= set(logs[0])  # what `alignflow compare` plots of distillation
    assert end < 0.5 * start
    assert all(torch.equal(p, b) for p, b in zip(teacher.parameters(), before))


@pytest.mark.slow
def test_a_teacher_on_a_device_of_its_own_trains_the_student_as_one_on_the_policys(tiny, demonstrations, tmp_path):
    """``teacher_device: cpu`` keeps the teacher frozen outside accelerate on its device, samples
    (``seq_kd``) and scores there and hands its logits back: the same weights as the policy's device
    (on this CPU machine both are the CPU: the values through the other path; gpu_check crosses devices)."""
    model, tokenizer = tiny
    teacher = perturbed(model, 0.05, 0)
    trained = {}
    for placement in ("policy", "cpu"):
        trainer = make_trainer(
            copy.deepcopy(model),
            copy.deepcopy(teacher),
            tokenizer,
            demonstrations,
            tmp_path / placement,
            lmbda=0.5,
            seq_kd=True,
            max_steps=4,
            teacher_device=placement,
        )
        trainer.train()
        assert trainer.teacher_device == torch.device("cpu")
        assert not any(p.requires_grad for p in trainer.teacher.parameters())
        trained[placement] = [p.detach().clone() for p in trainer.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(trained["policy"], trained["cpu"]))
    assert not all(torch.equal(a, b) for a, b in zip(trained["cpu"], model.parameters()))


@pytest.mark.slow
def test_a_teacher_with_a_padded_embedding_samples_only_the_tokenizers_ids(tiny, demonstrations, tmp_path):
    """A teacher whose embedding is wider than the tokenizer (``builtin:llama-20m``: 16,384 rows, 103
    tokens) samples (``seq_kd``) only the tokenizer's ids, which the student can embed: its padded
    rows, here made the likeliest, would otherwise be drawn."""
    model, tokenizer = tiny
    teacher = perturbed(model, 0.05, 0)
    teacher.resize_token_embeddings(len(tokenizer) + 29)
    with torch.no_grad():
        teacher.get_output_embeddings().weight[len(tokenizer) :] = 10 * teacher.get_output_embeddings().weight[:29]
    trainer = make_trainer(
        copy.deepcopy(model), teacher, tokenizer, demonstrations, tmp_path, lmbda=0.0, seq_kd=True, max_steps=2
    )
    batch = trainer.teacher_batch(PromptCompletionCollator(tokenizer.pad_token_id)(demonstrations), 7)
    assert batch["input_ids"].max().item() < len(tokenizer) and batch["completion_mask"].sum() > 0
    trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.unit
def test_sampled_completions_that_would_pass_the_students_context_are_refused_when_the_trainer_is_built(
    tiny, demonstrations, tmp_path
):
    model, tokenizer = tiny
    model = copy.deepcopy(model)  # the trainers freeze their teacher: not the session's model
    longest = max(len(row["prompt_ids"]) for row in demonstrations)
    assert (longest, model.config.max_position_embeddings) == (4, 128)
    with pytest.raises(ValueError) as error:
        make_trainer(model, model, tokenizer, demonstrations, tmp_path, max_new_tokens=125, lmbda=0.0, seq_kd=True)
    assert str(error.value) == (
        "distill: the longest prompt (4 tokens) + distill.max_new_tokens (125) is 129 tokens, beyond the model's "
        "context (128 positions): set distill.max_new_tokens to at most 124, or cut the prompts shorter "
        "(data.max_prompt_length)"
    )
    assert make_trainer(model, model, tokenizer, demonstrations, tmp_path, max_new_tokens=124).args.lmbda == 0.5
    # nothing is sampled without on-policy steps or seq_kd: the data's completions fit already
    assert (
        make_trainer(model, model, tokenizer, demonstrations, tmp_path, max_new_tokens=125, lmbda=0.0).args.seq_kd
        is False
    )
