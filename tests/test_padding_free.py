"""Padding-free batches (``compute.padding_free``): the packing plan, and every pass over whole
sequences giving the padded batch's per-row log-probs, losses and gradients to 1e-5 in float32,
on the built-in Llama (rotary embeddings), under both attention implementations that build masks
(``sdpa``, ``eager``) and in both layouts (packs as wide as the longest row; one pack, as varlen
kernels take it)."""

from __future__ import annotations

import copy
import random

import datasets
import pytest
import torch
from helpers import QUIET_TRAINING

from trainers.data.collators import CompletionOnlyCollator, PreferenceCollator, prompt_completion_batch
from trainers.data.packing import PackedBatch, plan_one_pack, plan_packs
from trainers.models.attention import Packing, PaddingFreeError, packing_for
from trainers.scoring.logprobs import completion_logps, next_token_logps

pytestmark = pytest.mark.unit
TOLERANCE = 1e-5
# packs as wide as the longest row, the cheapest widths (a pair cost that joins rows), one pack
LAYOUTS = [
    Packing(one_pack=False, always=True),
    Packing(one_pack=False, pair_cost=1e-4, always=True),
    Packing(one_pack=True, always=True),
]
LAYOUT_IDS = ["longest-row", "cheapest", "one-pack"]


def model_with(tiny, implementation: str):
    model = copy.deepcopy(tiny[0]).float()
    model.set_attn_implementation(implementation)
    with torch.no_grad():  # away from the fresh init: rows' log-probs differ visibly
        generator = torch.Generator().manual_seed(1)
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def random_rows(count: int, seed: int, vocabulary: int, longest: int = 40) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of long-tailed lengths: most short, a few near ``longest``."""
    rng = random.Random(seed)

    def length() -> int:
        return min(longest, max(1, int(rng.paretovariate(1.2) * 3)))

    return [
        (
            [rng.randrange(8, vocabulary) for _ in range(length())],
            [rng.randrange(8, vocabulary) for _ in range(length())],
        )
        for _ in range(count)
    ]


def grads(model) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE


def assert_same_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient to 1e-5 of its own scale (a gradient of a sum over hundreds of tokens
    reaches a few units, where float32 keeps about 1e-6 of it)."""
    assert got.keys() == expected.keys() and got
    for name in expected:
        scale = max(1.0, expected[name].abs().max().item())
        assert (got[name] - expected[name]).abs().max().item() <= TOLERANCE * scale, name


def test_best_fit_decreasing_places_every_row_once_within_the_longest_rows_width():
    plan = plan_packs([40, 7, 23, 31, 12, 3])
    # 40 fills pack 0; 31 opens 1 (9 left); 23 opens 2 (17 left); 12 fits 2 best; 7 fits 1 (9); 3 fits 2 (5)
    assert (plan.count, plan.width) == (3, 40)
    assert plan.packs == (0, 1, 2, 1, 2, 2) and plan.offsets == (0, 31, 0, 0, 23, 35)
    assert plan.positions()[2].tolist() == list(range(23)) + list(range(12)) + list(range(3)) + [0, 1]
    one = plan_one_pack([4, 2, 3])
    assert (one.count, one.width, one.offsets) == (1, 9, (0, 4, 6))
    assert one.positions().tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    with pytest.raises(ValueError, match="a row of 9 tokens does not fit packs of 8"):
        plan_packs([9, 2], width=8)


def test_the_cheapest_plan_weighs_filler_against_attention_across_rows():
    from trainers.data.packing import plan_cheapest

    # the 20M shape's pair cost: a long-tailed batch costs least in one pack (2,500 + 2,500²/2,304)
    # rather than two packs of the longest row (2 · (1,800 + 1,800²/2,304)), filler and all
    long_tail = plan_cheapest([1800, 400, 200, 100], 1 / 2304)
    assert (long_tail.count, long_tail.width) == (1, 2500)
    # where attention is dear, equal rows keep a pack each: 4 · (50 + 0.1 · 50²) beats 2 · (100 + 0.1 · 100²)
    even = plan_cheapest([50, 50, 50, 50], 0.1)
    assert (even.count, even.width) == (4, 50)
    # the built-in shapes' pair costs: 4d over 2h(2d + 2d_kv + 3I)
    from transformers import LlamaConfig

    from trainers.models.attention import pair_cost
    from trainers.models.builtin import BUILTIN_MODELS

    assert [round(1 / pair_cost(LlamaConfig(**BUILTIN_MODELS[n]))) for n in ("llama-20m", "llama-0.5b")] == [2304, 8320]


def test_a_packed_batch_places_each_rows_tokens_and_refuses_rows_with_holes():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]])  # left and right padding at once
    ids = torch.arange(15).view(3, 5)
    packed = PackedBatch.of(mask, Packing(one_pack=False))
    assert packed.scatter(ids, mask, fill=-1).tolist() == [[1, 2, 3], [12, 13, 14], [5, 6, -1]]
    assert packed.position_ids(torch.device("cpu")).tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 0]]
    with pytest.raises(ValueError, match="row 1's tokens are not contiguous"):
        PackedBatch.of(torch.tensor([[1, 1, 1], [1, 0, 1]]), Packing(one_pack=False))


def test_auto_packs_where_the_attention_keeps_rows_apart_and_true_is_refused_elsewhere(tiny):
    model = model_with(tiny, "sdpa")
    # the tiny Llama's pair cost: 4·128 / (2·128·(128 + 2·128 + 128 + 3·384))
    assert packing_for(model, "auto") == Packing(one_pack=False, pair_cost=1 / 832)
    assert packing_for(model, True) == Packing(one_pack=False, pair_cost=1 / 832, always=True)
    assert packing_for(model, False) is None
    plain = torch.nn.Linear(2, 2)  # no transformers attention at all
    assert packing_for(plain, "auto") is None
    with pytest.raises(PaddingFreeError, match="compute.padding_free: true, but its attention implementation 'None'"):
        packing_for(plain, True)


def test_auto_packs_a_long_tailed_batch_and_leaves_a_batch_of_equal_rows_padded(tiny):
    from trainers.data.packing import packed_batch

    auto, required = Packing(one_pack=False, pair_cost=1 / 832), Packing(one_pack=False, pair_cost=1 / 832, always=True)
    even = torch.ones(8, 10, dtype=torch.long)
    even[::2, -1] = 0  # rows of 9 and 10 tokens: no two share a pack of 10, and wider packs cost more
    assert packed_batch(even, auto) is None and packed_batch(even, required) is not None
    ragged = torch.zeros(8, 40, dtype=torch.long)
    for row, length in enumerate([40, 3, 5, 8, 2, 6, 4, 9]):
        ragged[row, :length] = 1
    packed = packed_batch(ragged, auto)  # 77 real tokens of 320 padded slots
    assert packed is not None and packed.plan.count * packed.plan.width < 8 * 40 * 0.9


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("packing", LAYOUTS, ids=LAYOUT_IDS)
def test_completion_logps_and_their_gradients_equal_the_padded_ones(tiny, implementation, packing):
    model = model_with(tiny, implementation)
    rows = random_rows(12, seed=0, vocabulary=len(tiny[1]))
    batch = prompt_completion_batch([p for p, _ in rows], [c for _, c in rows], tiny[1].pad_token_id)
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert PackedBatch.of(mask, packing).plan.count < len(rows)  # rows do share packs
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) + 0.5
    outputs = {}
    for name, layout in (("padded", None), ("packed", packing)):
        got = completion_logps(model, ids, mask, completion, token_weights=weights, wpo_terms=True, packing=layout)
        (got.logps.sum() + 0.5 * got.unweighted_logps.sum()).backward()
        outputs[name] = (got, grads(model))
    (padded, padded_grads), (packed, packed_grads) = outputs["padded"], outputs["packed"]
    for field in ("logps", "num_tokens", "logit_sums", "wpo_logweights", "unweighted_logps"):
        assert_close(getattr(packed, field), getattr(padded, field))
    assert_same_grads(packed_grads, padded_grads)


@pytest.mark.parametrize("packing", LAYOUTS, ids=LAYOUT_IDS)
def test_token_logps_and_entropies_of_left_padded_prompts_equal_the_padded_ones(tiny, packing):
    """GRPO's layout: prompts padded on the left, completions on the right."""
    model = model_with(tiny, "sdpa")
    rows = random_rows(10, seed=1, vocabulary=len(tiny[1]))
    pad = tiny[1].pad_token_id
    prompt_width = max(len(p) for p, _ in rows)
    sequences = [[pad] * (prompt_width - len(p)) + p + c for p, c in rows]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    mask = torch.tensor(
        [
            [0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(s))
            for (p, c), s in zip(rows, sequences)
        ]
    )
    completion = torch.tensor(
        [[0] * prompt_width + [1] * len(c) + [0] * (width - len(s)) for (p, c), s in zip(rows, sequences)]
    )
    outputs = {}
    for name, layout in (("padded", None), ("packed", packing)):
        got = next_token_logps(model, ids, mask, completion, 0.7, entropy=True, packing=layout)
        (got.logps.sum() + 0.1 * got.entropy.sum()).backward()
        outputs[name] = (got, grads(model))
    (padded, padded_grads), (packed, packed_grads) = outputs["padded"], outputs["packed"]
    assert_close(packed.logps, padded.logps)
    assert_close(packed.entropy, padded.entropy)
    assert_same_grads(packed_grads, padded_grads)


def test_rows_packed_without_restarting_positions_would_attend_to_each_other(tiny):
    """The control: the packed values equal the padded ones because the positions restart, nothing else."""
    model = model_with(tiny, "sdpa")
    rows = [([9, 10, 11], [12, 13]), ([14, 15], [16, 17, 18])]
    batch = prompt_completion_batch([p for p, _ in rows], [c for _, c in rows], tiny[1].pad_token_id)
    packed = PackedBatch.of(batch["attention_mask"], Packing(one_pack=True))
    ids = packed.scatter(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        apart = model(input_ids=ids, position_ids=packed.position_ids(ids.device), use_cache=False).logits
        together = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
        alone = model(input_ids=torch.tensor([rows[1][0] + rows[1][1]])).logits
    assert (apart[0, 5:] - alone[0]).abs().max().item() <= TOLERANCE
    assert (together[0, 5:] - alone[0]).abs().max().item() > 1e-2


def test_sfts_loss_is_the_causal_lms_own_padded_or_packed_and_so_are_its_gradients(tiny, tmp_path):
    """SFT's loss (the shared log-prob pass) against transformers' causal-LM loss from the same labels:
    the value and the gradients, padded and packed, alone and with an accumulation window's count."""
    from trainers.sft.trainer import SFTArguments, SFTTrainer

    model = model_with(tiny, "sdpa")
    rows = [{"prompt_ids": p, "completion_ids": c} for p, c in random_rows(12, seed=2, vocabulary=len(tiny[1]))]
    batch = CompletionOnlyCollator(tiny[1].pad_token_id)(rows)
    window = int(batch["labels"].ne(-100).sum()) * 3  # as if two more micro-batches shared the window

    expected = model(**batch, use_cache=False).loss
    expected.backward()
    expected_grads = grads(model)
    assert abs(model(**batch, use_cache=False, num_items_in_batch=window).loss.item() - expected.item() / 3) < 1e-6
    for padding_free in (False, True):
        args = SFTArguments(output_dir=str(tmp_path), **QUIET_TRAINING, padding_free=padding_free)
        trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
        assert (trainer.packing is not None) == padding_free
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        assert_close(loss.detach(), expected.detach())
        assert_same_grads(grads(model), expected_grads)
        assert abs(trainer.compute_loss(model, batch, num_items_in_batch=window).item() - expected.item() / 3) < 1e-6


@pytest.fixture(scope="module")
def long_pairs(tiny) -> list[dict]:
    rng = random.Random(3)
    rows = random_rows(16, seed=3, vocabulary=len(tiny[1]))
    return [
        {"prompt_ids": p, "chosen_ids": c, "rejected_ids": random_rows(1, rng.randrange(10**6), len(tiny[1]))[0][1]}
        for p, c in rows
    ]


def trainer_loss_and_grads(build, padding_free, batch):
    trainer = build(padding_free)
    model = trainer.model
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.detach(), grads(model)


def assert_trainer_is_padding_free_exact(build, batch):
    padded, padded_grads = trainer_loss_and_grads(build, False, batch)
    packed, packed_grads = trainer_loss_and_grads(build, True, batch)
    assert_close(packed, padded)
    assert_same_grads(packed_grads, padded_grads)


def test_dpo_with_a_live_reference_and_its_options(tiny, long_pairs, tmp_path):
    from trainers.dpo.trainer import DPOConfig, DPOTrainer

    policy, reference = model_with(tiny, "sdpa"), copy.deepcopy(tiny[0]).float()

    def build(padding_free):
        args = DPOConfig(
            output_dir=str(tmp_path),
            **QUIET_TRAINING,
            beta=0.3,
            reference="live",
            padding_free=padding_free,
            loss_type=["sigmoid", "sft"],
            loss_weights=[1.0, 0.5],
            ld_alpha=0.5,
            use_weighting=True,
        )
        data = datasets.Dataset.from_list(long_pairs)
        return DPOTrainer(
            model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args, train_dataset=data
        )

    assert build(True).packing == Packing(one_pack=False, pair_cost=1 / 832, always=True)
    assert build("auto").packing == Packing(one_pack=False, pair_cost=1 / 832) and build(False).packing is None
    assert_trainer_is_padding_free_exact(build, PreferenceCollator(tiny[1].pad_token_id)(long_pairs))


def test_kto_with_a_live_reference(tiny, long_pairs, tmp_path):
    from trainers.kto.data import unpaired, with_kl_completions
    from trainers.kto.trainer import KTOConfig, KTOTrainer, UnpairedCollator

    policy, reference = model_with(tiny, "sdpa"), copy.deepcopy(tiny[0]).float()
    rows = with_kl_completions(unpaired(long_pairs))

    def build(padding_free):
        args = KTOConfig(
            output_dir=str(tmp_path), **QUIET_TRAINING, beta=0.2, reference="live", padding_free=padding_free
        )
        return KTOTrainer(
            model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args, train_dataset=rows
        )

    assert_trainer_is_padding_free_exact(build, UnpairedCollator(tiny[1].pad_token_id)(list(rows)[:12]))


@pytest.mark.parametrize("head", ["classifier", "likelihood"])
def test_the_reward_stage(tiny_checkpoint, long_pairs, tmp_path, head):
    from trainers.reward.trainer import PairSequenceCollator, RewardConfig, RewardTrainer
    from trainers.scoring.reward_model import load_reward_model

    model, tokenizer, _ = load_reward_model(tiny_checkpoint.path, head=head)
    model = model.float()
    if head == "classifier":
        torch.manual_seed(0)
        torch.nn.init.normal_(model.score.weight, std=0.5)

    def build(padding_free):
        args = RewardConfig(output_dir=str(tmp_path), **QUIET_TRAINING, head=head, padding_free=padding_free)
        return RewardTrainer(model=copy.deepcopy(model), args=args, train_dataset=long_pairs)

    assert_trainer_is_padding_free_exact(build, PairSequenceCollator(tokenizer.pad_token_id)(long_pairs))


@pytest.mark.parametrize("head", ["classifier", "likelihood"])
def test_a_reward_model_scores_completions_padding_free_as_it_does_padded(tiny_checkpoint, long_pairs, head):
    """``RewardModelScorer`` (a GRPO reward function, the evaluation's reward model): packed scores equal
    the padded ones, in batches that mix short and long rows."""
    from trainers.scoring.reward_model import RewardModelScorer, load_reward_model

    model, tokenizer, _ = load_reward_model(tiny_checkpoint.path, head=head)
    model = model.float()
    if head == "classifier":
        torch.manual_seed(0)
        torch.nn.init.normal_(model.score.weight, std=0.5)
    sequences = [(p["prompt_ids"], p["chosen_ids"]) for p in long_pairs]
    packed = RewardModelScorer(model, tokenizer, head, "model:rm", batch_size=5, padding_free=True)
    padded = RewardModelScorer(model, tokenizer, head, "model:rm", batch_size=5, padding_free=False)
    assert packed.packing is not None and padded.packing is None
    assert_close(torch.tensor(packed.score_ids(sequences)), torch.tensor(padded.score_ids(sequences)))


def test_distillation_student_and_teacher_passes(tiny, long_pairs, tmp_path):
    from trainers.distill.trainer import DistillConfig, DistillTrainer, PromptCompletionCollator

    student, teacher = model_with(tiny, "sdpa"), copy.deepcopy(tiny[0]).float()
    rows = [{"prompt_ids": p["prompt_ids"], "completion_ids": p["chosen_ids"]} for p in long_pairs]

    def build(padding_free):
        args = DistillConfig(
            output_dir=str(tmp_path), **QUIET_TRAINING, beta=0.5, temperature=0.8, lmbda=0.0, padding_free=padding_free
        )
        return DistillTrainer(
            model=copy.deepcopy(student), teacher_model=teacher, args=args, train_dataset=rows, processing_class=tiny[1]
        )

    assert_trainer_is_padding_free_exact(build, PromptCompletionCollator(tiny[1].pad_token_id)(rows))


def completion_count(completions, **kwargs) -> list[float]:
    return [float(len(c)) for c in completions]


def test_grpo_log_prob_passes_and_loss(tiny, tmp_path):
    from policies import SHORT_GRPO, grpo_args

    from trainers.grpo.trainer import GRPOTrainer

    policy = model_with(tiny, "sdpa")
    rows = random_rows(8, seed=4, vocabulary=len(tiny[1]))
    pad = tiny[1].pad_token_id
    prompt_width = max(len(p) for p, _ in rows)
    completion_width = max(len(c) for _, c in rows)
    ids, mask, completion = [], [], []
    for p, c in rows:
        left, right = prompt_width - len(p), completion_width - len(c)
        ids.append([pad] * left + p + c + [pad] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        completion.append([0] * prompt_width + [1] * len(c) + [0] * right)
    part = {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(mask),
        "completion_mask": torch.tensor(completion),
    }

    def build(padding_free):
        args = grpo_args(tmp_path, **(SHORT_GRPO | dict(beta=0.1, padding_free=padding_free, loss_type="dapo")))
        prompts = datasets.Dataset.from_list([{"prompt_ids": p} for p, _ in rows])
        return GRPOTrainer(
            model=copy.deepcopy(policy),
            args=args,
            train_dataset=prompts,
            processing_class=tiny[1],
            reward_funcs=[completion_count],
        )

    def batch_of(trainer):
        slices = [dict(part)]
        trainer.add_token_logps(trainer.ref_model, slices, "ref_logps")
        trainer.add_token_logps(trainer.model, slices, "old_logps")
        advantages = torch.linspace(-1, 1, len(rows))
        return slices[0] | {
            "advantages": advantages,
            "tokens_per_step": torch.tensor(int(part["completion_mask"].sum())),
        }

    padded_trainer, packed_trainer = build(False), build(True)
    padded_batch, packed_batch = batch_of(padded_trainer), batch_of(packed_trainer)
    for name in ("ref_logps", "old_logps"):
        assert_close(packed_batch[name], padded_batch[name])
    with torch.no_grad():  # the loss reads a ratio that differs from 1
        padded_batch["old_logps"] = packed_batch["old_logps"] = padded_batch["old_logps"] - 0.05
    losses = []
    for trainer, batch in ((padded_trainer, padded_batch), (packed_trainer, packed_batch)):
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        losses.append((loss.detach(), grads(trainer.model)))
    assert_close(losses[1][0], losses[0][0])
    assert_same_grads(losses[1][1], losses[0][1])


def test_the_reference_pass_and_the_evaluations_pair_scores(tiny, long_pairs):
    from trainers.evaluation.evaluate import preference_rewards
    from trainers.scoring.reference_pass import reference_logps

    model, tokenizer = model_with(tiny, "sdpa"), tiny[1]
    padded = reference_logps(model, tokenizer.pad_token_id, long_pairs, 5, progress=False, padding_free=False)
    packed = reference_logps(model, tokenizer.pad_token_id, long_pairs, 5, progress=False, padding_free=True)
    for got, expected in zip(packed, padded):
        assert_close(torch.tensor(got), torch.tensor(expected))
    scored = [row | {"ref_chosen_logps": c - 1.0, "ref_rejected_logps": r} for row, c, r in zip(long_pairs, *padded)]
    on = preference_rewards(model, tokenizer, scored, 0.5, 5, padding_free=True)
    off = preference_rewards(model, tokenizer, scored, 0.5, 5, padding_free=False)
    assert on.keys() == off.keys()
    for name in on:
        assert abs(on[name] - off[name]) <= TOLERANCE


def test_token_budget_batches_hold_every_row_once_within_the_budget_and_reshuffle_per_epoch():
    from trainers.data.packing import TokenBudgetBatches

    lengths = [40, 7, 23, 31, 12, 3, 25, 25, 1, 39]
    batches = TokenBudgetBatches(lengths, budget=50, seed=3)
    first = list(batches)
    assert sorted(row for batch in first for row in batch) == list(range(len(lengths)))
    assert all(sum(lengths[row] for row in batch) <= 50 for batch in first)
    assert len(batches) == len(first) == 5  # 206 tokens: 5 batches of ≤ 50, as best-fit decreasing packs them
    batches.set_epoch(1)
    second = list(batches)
    assert sorted(map(sorted, second)) == sorted(map(sorted, first)) and second != first
    with pytest.raises(ValueError, match="sft.batch_tokens: row 0 has 40 tokens, more than the budget of 30"):
        TokenBudgetBatches(lengths, budget=30, seed=0)


def test_a_packed_sft_epoch_trains_on_every_row_once(tiny, tmp_path):
    from trainers.sft.trainer import SFTArguments, SFTTrainer

    model, tokenizer = model_with(tiny, "sdpa"), tiny[1]
    rows = [{"prompt_ids": p, "completion_ids": c} for p, c in random_rows(24, seed=5, vocabulary=len(tokenizer))]
    seen: list[tuple[int, ...]] = []

    class Recording(CompletionOnlyCollator):
        def __call__(self, features):
            seen.extend(tuple(f["prompt_ids"] + f["completion_ids"]) for f in features)
            batch = super().__call__(features)
            assert batch["attention_mask"].sum() <= budget
            return batch

    budget = 64
    args = SFTArguments(output_dir=str(tmp_path), **QUIET_TRAINING, num_train_epochs=1, batch_tokens=budget)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=Recording(tokenizer.pad_token_id),
    )
    expected_batches = len(trainer.get_train_dataloader())
    trainer.train()
    assert sorted(seen) == sorted(tuple(r["prompt_ids"] + r["completion_ids"]) for r in rows)
    assert trainer.state.global_step == expected_batches < len(rows)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("packing", [Packing(one_pack=False, always=True), None], ids=["packed", "padded"])
def test_the_head_applied_in_chunks_gives_the_materialised_logits_values_and_gradients(
    tiny, monkeypatch, temperature, packing
):
    """Past ``HEAD_IN_CHUNKS_ELEMENTS`` the pass, packed or padded, stops at the head's input and applies
    the head chunk by chunk (here forced, with chunks of 7 positions): log-probs, entropies and every
    gradient (the tied embedding's included) equal those through the materialised logits."""
    from trainers.scoring import logprobs

    model = model_with(tiny, "sdpa")
    rows = random_rows(10, seed=6, vocabulary=len(tiny[1]))
    batch = prompt_completion_batch([p for p, _ in rows], [c for _, c in rows], tiny[1].pad_token_id)
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    results = []
    for threshold in (1 << 40, 0):
        monkeypatch.setattr(logprobs, "HEAD_IN_CHUNKS_ELEMENTS", threshold)
        monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 7 * model.config.vocab_size)
        forward = logprobs.forward_scored_positions(model, ids, mask, completion, packing)
        assert (forward.head is not None) == (threshold == 0)
        if forward.head is not None:
            assert forward.logits.shape[1] == 0  # the model's own head projected nothing
        got = next_token_logps(model, ids, mask, completion, temperature, entropy=True, packing=packing)
        (got.logps.sum() + 0.3 * got.entropy.sum()).backward()
        results.append((got, grads(model)))
    (materialised, expected_grads), (chunked, chunked_grads) = results
    assert_close(chunked.logps, materialised.logps)
    assert_close(chunked.entropy, materialised.entropy)
    assert_same_grads(chunked_grads, expected_grads)
    with pytest.raises(ValueError, match="kept no logits"):
        forward.scored_logits()
