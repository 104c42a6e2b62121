import pytest

from infra.config import PromotionConfig
from tasks.evaluate import NOTHING_EVALUATED, EvalReport
from tasks.promote import gate


def report(candidate: float, champion: float | None) -> EvalReport:
    rows = {"dpo": {"sampled_accuracy": candidate}}
    if champion is not None:
        rows["champion"] = {"sampled_accuracy": champion}
    return EvalReport(rows=rows, num_prompts=10, num_pairs=0, mlflow_run_id="run")


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
def test_gate_needs_a_real_improvement_of_at_least_min_improvement(candidate, champion, min_improvement, promoted):
    config = PromotionConfig(registered_model="m", metric="sampled_accuracy", min_improvement=min_improvement)
    verdict, reason = gate(report(candidate, champion), "dpo", config)
    assert verdict is promoted
    assert "sampled_accuracy" in reason


def test_the_summary_says_when_nothing_was_evaluated():
    empty = EvalReport(rows={"base": {}}, num_prompts=0, num_pairs=0, mlflow_run_id="r")
    assert empty.summary() == NOTHING_EVALUATED
    scored = EvalReport(rows={"base": {"greedy_accuracy": 0.5}}, num_prompts=2, num_pairs=0, mlflow_run_id="r")
    assert scored.summary() == "Evaluation (2 held-out prompts, 0 held-out pairs):\n" + scored.markdown()
    assert "| base | 0.500 |" in scored.markdown()
