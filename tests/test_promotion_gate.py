import pytest

from infra.core.config import PromotionConfig
from infra.core.handles import ModelHandle, PreparedData
from tasks.evaluate import NOTHING_EVALUATED, EvalReport
from tasks.promote import EVAL_PROMPTS_TAG, Champion, comparability, gate, significant_gain

pytestmark = pytest.mark.unit


def handle(tokenizer: str = "tok") -> ModelHandle:
    return ModelHandle(path="m", fingerprint="w", tokenizer_fingerprint=tokenizer, stage="champion")


CHAMPION = Champion(version="3", model=handle())


def report(candidate: float, champion: float | None, per_prompt=None) -> EvalReport:
    rows = {"dpo": {"sampled_accuracy": candidate}}
    if champion is not None:
        rows["champion"] = {"sampled_accuracy": champion}
    return EvalReport(rows=rows, num_prompts=10, num_pairs=0, mlflow_run_id="run", per_prompt=per_prompt or {})


@pytest.mark.parametrize(
    "candidate, champion, min_improvement, promoted",
    [
        (0.40, None, 0.05, True),  # no champion yet: the first model becomes one
        (0.80, 0.70, 0.05, True),  # +0.10 >= 0.05
        (0.74, 0.70, 0.05, False),  # +0.04 < 0.05
        (0.70, 0.70, 0.0, False),  # equal (a rerun): no churn in the registry
        (0.71, 0.70, 0.0, True),
        (0.60, 0.70, 0.0, False),
    ],
)
def test_without_a_significance_test_the_gate_needs_a_gain_of_at_least_min_improvement(
    candidate, champion, min_improvement, promoted
):
    config = PromotionConfig(registered_model="m", min_improvement=min_improvement, confidence=None)
    verdict, reason = gate(report(candidate, champion), "dpo", config, CHAMPION if champion is not None else None)
    assert verdict is promoted
    assert "sampled_accuracy" in reason


@pytest.mark.parametrize(
    "candidate, champion, min_value, promoted",
    [
        (0.0, None, 0.0, False),  # a model that scores 0 is never the first champion
        (0.01, None, 0.0, True),
        (0.30, None, 0.3, False),  # the floor must be exceeded
        (0.0, None, None, True),  # no floor
        (0.25, 0.10, 0.3, False),  # a gain over a champion does not lift a model over the floor
    ],
)
def test_the_floor_applies_to_every_promotion_the_first_included(candidate, champion, min_value, promoted):
    config = PromotionConfig(registered_model="m", min_value=min_value, confidence=None)
    verdict, reason = gate(report(candidate, champion), "dpo", config, CHAMPION if champion is not None else None)
    assert verdict is promoted
    if not promoted:
        assert reason == f"sampled_accuracy = {candidate:.4f}, needed > {min_value} (promotion.min_value)"


def paired(candidate_correct: int, champion_correct: int, prompts: int = 40) -> EvalReport:
    """Per-prompt 0/1 scores where the champion's correct prompts are a subset of the candidate's."""
    scores = {
        "dpo": [1.0] * candidate_correct + [0.0] * (prompts - candidate_correct),
        "champion": [1.0] * champion_correct + [0.0] * (prompts - champion_correct),
    }
    return report(
        candidate_correct / prompts,
        champion_correct / prompts,
        {label: {"sampled_accuracy": values} for label, values in scores.items()},
    )


def test_a_gain_within_the_noise_is_not_significant_and_a_consistent_one_is():
    config = PromotionConfig(registered_model="m", confidence=0.95)
    small = paired(21, 20)  # one prompt better out of 40: +0.025
    verdict, reason = gate(small, "dpo", config, CHAMPION)
    assert not verdict and "95% lower bound of the gain +0.0000, needed > 0" in reason
    large = paired(30, 20)  # ten prompts better, none worse
    verdict, reason = gate(large, "dpo", config, CHAMPION)
    assert verdict and "gain +0.2500" in reason
    # the bound is the 5% quantile of the bootstrap mean gain: ten +1s among 40 prompts
    assert 0.1 < significant_gain(*(large.per_prompt[m]["sampled_accuracy"] for m in ("dpo", "champion")), 0.95) < 0.25


def test_an_incomparable_champion_is_never_replaced():
    config = PromotionConfig(registered_model="m", confidence=None)
    champion = Champion(version="3", model=handle(), incomparable="the champion uses another tokenizer")
    verdict, reason = gate(report(0.9, None), "dpo", config, champion)
    assert not verdict and reason == "champion version 3 is not comparable: the champion uses another tokenizer"
    assert champion.models() == {} and CHAMPION.models() == {"champion": CHAMPION.model}


def test_comparability_needs_the_same_tokenizer_and_the_same_held_out_prompts():
    data = PreparedData(
        path="d", fingerprint="f", rows={}, dropped={}, token_fingerprints={"eval_prompts": "E"}, truncation={}
    )
    assert comparability({}, handle("tok"), handle("tok"), data) is None  # a version registered before the tags
    assert comparability({EVAL_PROMPTS_TAG: "E"}, handle("tok"), handle("tok"), data) is None
    assert "another tokenizer" in comparability({}, handle("other"), handle("tok"), data)
    assert "another task's held-out prompts" in comparability({EVAL_PROMPTS_TAG: "X"}, handle(), handle(), data)


def test_the_summary_says_when_nothing_was_evaluated():
    empty = EvalReport(rows={"base": {}}, num_prompts=0, num_pairs=0, mlflow_run_id="r")
    assert empty.summary() == NOTHING_EVALUATED
    scored = EvalReport(rows={"base": {"greedy_accuracy": 0.5}}, num_prompts=2, num_pairs=0, mlflow_run_id="r")
    assert scored.summary() == "Evaluation (2 held-out prompts, 0 held-out pairs):\n" + scored.markdown()
    assert "| base | 0.500 |" in scored.markdown()
