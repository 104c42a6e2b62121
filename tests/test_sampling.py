"""GRPO's sampler: inverse transform sampling draws from softmax(scores) after the warpers, never a
−inf token, and ``generate`` under greedy decoding emits exactly the drawn tokens."""

import math

import pytest
import torch

from trainers.generation.token_sampling import InverseCdfSampling, VocabularyMask, sampling_processors
from trainers.models.builtin import build_builtin_model

pytestmark = pytest.mark.unit

DRAWS = 40_000
SCORES = torch.tensor([2.0, 0.5, -1.0, 1.0, float("-inf"), 0.0])


def frequencies(scores: torch.Tensor, processors) -> torch.Tensor:
    """Token frequencies over DRAWS rows of the same scores, each row drawn once."""
    torch.manual_seed(0)
    rows = scores.expand(DRAWS, -1).clone()
    out = processors(torch.zeros((DRAWS, 1), dtype=torch.long), rows)
    assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(DRAWS, dtype=torch.long))  # one token per row
    return torch.bincount(out.argmax(-1), minlength=scores.numel()).double() / DRAWS


def assert_distribution(observed: torch.Tensor, expected: torch.Tensor) -> None:
    sigma = (expected * (1 - expected) / DRAWS).sqrt()
    assert torch.all((observed - expected).abs() <= 4 * sigma + 1e-12), (observed, expected)


def test_draws_follow_the_softmax_and_never_a_minus_inf_token():
    observed = frequencies(SCORES, InverseCdfSampling())
    assert observed[4] == 0
    assert_distribution(observed, SCORES.double().softmax(-1))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "expected"),
    [
        (0.5, 0, 1.0, (SCORES.double() / 0.5).softmax(-1)),
        # top-2 of the scores: tokens 0 and 3, in proportion e^2 : e^1
        (1.0, 2, 1.0, torch.tensor([math.e / (math.e + 1), 0, 0, 1 / (math.e + 1), 0, 0], dtype=torch.float64)),
    ],
)
def test_the_warpers_apply_before_the_draw(temperature, top_k, top_p, expected):
    assert_distribution(frequencies(SCORES, sampling_processors(temperature, top_k, top_p)), expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probabilities = SCORES.double().softmax(-1)  # sorted: tokens 0 (.57), 3 (.21), 1 (.13), ...
    observed = frequencies(SCORES, sampling_processors(top_p=0.75))
    kept = probabilities * torch.tensor([1, 0, 0, 1, 0, 0])
    assert_distribution(observed, kept / kept.sum())


def test_greedy_generate_emits_the_drawn_tokens():
    model, tokenizer = build_builtin_model("builtin:tiny-llama", seed=0)
    model.eval()
    prompt = torch.tensor([tokenizer.encode("12+7=")])
    drawn = []

    class Recorder(InverseCdfSampling):
        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            drawn.append(out.argmax(-1))
            return out

    torch.manual_seed(3)
    output = model.generate(
        input_ids=prompt.repeat(8, 1),
        attention_mask=torch.ones((8, prompt.shape[1]), dtype=torch.long),
        do_sample=False,
        max_new_tokens=4,
        min_new_tokens=4,
        logits_processor=[Recorder()],
        pad_token_id=tokenizer.pad_token_id,
    )
    assert torch.equal(output[:, prompt.shape[1] :], torch.stack(drawn, dim=1))
    assert len({tuple(row.tolist()) for row in output}) > 1  # sampled, not the one greedy completion


def test_the_vocabulary_mask_draws_only_the_tokenizers_ids_from_their_own_softmax():
    """Ids from ``vocabulary`` on (padded embedding rows) are never drawn, however high their score;
    the others keep their relative probabilities."""
    padded = torch.cat([SCORES, torch.tensor([9.0, 8.0])])  # two padded rows that would win almost always
    observed = frequencies(padded, sampling_processors(vocabulary=SCORES.numel()))
    assert observed[SCORES.numel() :].sum() == 0
    assert_distribution(observed[: SCORES.numel()], torch.softmax(SCORES, -1))
    assert torch.equal(VocabularyMask(6)(torch.zeros(1, 1), padded[None])[0, :6], padded[:6])
