"""Promotion gate: register the final model and move the ``champion`` alias only when it beats
the current champion, both scored on the same prompts and seeds in the same evaluation."""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from prefect import get_run_logger, task
from pydantic import BaseModel

from infra.config import PromotionConfig
from tasks.evaluate import EvalReport
from tasks.handles import ModelHandle
from tasks.tracking import client

CHAMPION_LABEL = "champion"


class PromotionDecision(BaseModel):
    promoted: bool
    reason: str
    version: str | None = None


@task(name="find-champion")
def champion_source(config: PromotionConfig) -> str | None:
    """``models:/<name>@<alias>`` when the registry has a champion, else None."""
    if config.registered_model is None:
        return None
    try:
        client().get_model_version_by_alias(config.registered_model, config.alias)
    except MlflowException:
        return None
    return f"models:/{config.registered_model}@{config.alias}"


def gate(report: EvalReport, candidate_label: str, config: PromotionConfig) -> tuple[bool, str]:
    value = report.rows[candidate_label][config.metric]
    if CHAMPION_LABEL not in report.rows:
        return True, f"first {config.alias}: {config.metric} = {value:.4f}"
    best = report.rows[CHAMPION_LABEL][config.metric]
    # It must improve, by at least min_improvement: an equal model (a rerun) changes nothing.
    verdict = value > best and value - best >= config.min_improvement
    return (
        verdict,
        f"{config.metric} {value:.4f} vs {config.alias} {best:.4f}: gain "
        f"{value - best:+.4f}, needed > 0 and >= {config.min_improvement}",
    )


@task(name="promote")
def promote(
    report: EvalReport, candidate: ModelHandle, candidate_label: str, config: PromotionConfig, parent_run_id: str
) -> PromotionDecision:
    promoted, reason = gate(report, candidate_label, config)
    get_run_logger().info("promotion of %s: %s (%s)", candidate_label, "accepted" if promoted else "rejected", reason)
    if not promoted:
        client().set_tag(parent_run_id, "alignflow.promotion", f"rejected: {reason}")
        return PromotionDecision(promoted=False, reason=reason)
    name = config.registered_model
    try:
        client().get_registered_model(name)
    except MlflowException:
        client().create_registered_model(name, description="Models promoted by the alignflow promotion gate.")
    source = f"{client().get_run(candidate.mlflow_run_id).info.artifact_uri}/model"
    figures = {f"eval.{metric}": f"{value:.6g}" for metric, value in report.rows[candidate_label].items()}
    version = client().create_model_version(
        name, source=source, run_id=candidate.mlflow_run_id, tags=figures | {"alignflow.promotion": reason}
    )
    client().set_registered_model_alias(name, config.alias, version.version)
    client().set_tag(parent_run_id, "alignflow.promotion", f"promoted: {name} version {version.version} ({reason})")
    return PromotionDecision(promoted=True, reason=reason, version=str(version.version))
