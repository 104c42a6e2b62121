"""Promotion gate: register the final model and move the ``champion`` alias only when it beats
the current champion, both scored on the same prompts and seeds in the same evaluation, by a
gain that a paired bootstrap over those prompts finds significant. A champion that cannot be
compared (another tokenizer, another task's held-out prompts) is never silently replaced."""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from prefect import get_run_logger, task
from pydantic import BaseModel

from infra.core.config import PromotionConfig
from infra.core.handles import ModelHandle, PreparedData
from tasks.evaluate import EvalReport
from tasks.mlflow_runs import client
from tasks.models import checkpoint_handle, download_mlflow_model
from trainers.scoring.metrics import bootstrap_ci

CHAMPION_LABEL = "champion"
BOOTSTRAP_SEED = 0
BOOTSTRAP_RESAMPLES = 2000
# Registered with each promoted version: what its figures are comparable with.
TOKENIZER_TAG = "alignflow.tokenizer_fingerprint"
EVAL_PROMPTS_TAG = "alignflow.eval_prompts_fingerprint"


class PromotionDecision(BaseModel):
    promoted: bool
    reason: str
    version: str | None = None


class Champion(BaseModel):
    """The current champion: its model, and why it cannot be compared with this run's, if so."""

    version: str
    model: ModelHandle
    incomparable: str | None = None

    def models(self) -> dict[str, ModelHandle]:
        """What the evaluation scores besides the run's own models: the champion, if comparable."""
        return {} if self.incomparable else {CHAMPION_LABEL: self.model}


def comparability(
    tags: dict[str, str], champion: ModelHandle, candidate: ModelHandle, data: PreparedData
) -> str | None:
    """Why the champion's figures cannot be compared with this run's, or None. Tokenizers are
    compared as saved with the trained models (both written by ``Trainer.save_model``)."""
    if champion.tokenizer_fingerprint != candidate.tokenizer_fingerprint:
        return "the champion uses another tokenizer: scoring it on this run's token ids would be meaningless"
    eval_prompts = data.token_fingerprints.get("eval_prompts")
    if tags.get(EVAL_PROMPTS_TAG, eval_prompts) != eval_prompts:
        return "the champion was promoted on another task's held-out prompts"
    return None


@task(name="find-champion")
def find_champion(config: PromotionConfig, candidate: ModelHandle, data: PreparedData) -> Champion | None:
    """The version behind ``promotion.alias``, or None when the registry has none. Only a missing
    registered model or alias means "no champion": any other registry error fails the task."""
    name = config.model_name
    try:
        registered = client().get_registered_model(name)
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    if config.alias not in registered.aliases:
        return None
    version = str(registered.aliases[config.alias])
    tags = client().get_model_version(name, version).tags
    model = checkpoint_handle(download_mlflow_model(f"models:/{name}/{version}"), CHAMPION_LABEL)
    return Champion(version=version, model=model, incomparable=comparability(tags, model, candidate, data))


def significant_gain(candidate: list[float], champion: list[float], confidence: float) -> float:
    """One-sided lower confidence bound of the mean per-prompt gain, by a seeded paired bootstrap
    over the prompts (both models scored on the same prompts, in the same order)."""
    gains = [c - b for c, b in zip(candidate, champion, strict=True)]
    low, _ = bootstrap_ci(gains, BOOTSTRAP_SEED, BOOTSTRAP_RESAMPLES, confidence=2 * confidence - 1)
    return low


def gate(
    report: EvalReport, candidate_label: str, config: PromotionConfig, champion: Champion | None
) -> tuple[bool, str]:
    value = report.rows[candidate_label][config.metric]
    if config.min_value is not None and not value > config.min_value:
        return False, f"{config.metric} = {value:.4f}, needed > {config.min_value} (promotion.min_value)"
    if champion is None:
        return True, f"first {config.alias}: {config.metric} = {value:.4f}"
    if champion.incomparable:
        return False, f"{config.alias} version {champion.version} is not comparable: {champion.incomparable}"
    best = report.rows[CHAMPION_LABEL][config.metric]
    gain = value - best
    # It must improve, by at least min_improvement: an equal model (a rerun) changes nothing.
    verdict = gain > 0 and gain >= config.min_improvement
    reason = (
        f"{config.metric} {value:.4f} vs {config.alias} {best:.4f}: "
        f"gain {gain:+.4f}, needed > 0 and >= {config.min_improvement}"
    )
    if config.confidence is not None:
        ours, theirs = (
            report.per_prompt.get(label, {}).get(config.metric) for label in (candidate_label, CHAMPION_LABEL)
        )
        if ours is None or theirs is None:
            return False, f"{reason}; no per-prompt values of {config.metric} for a paired test (set confidence: null)"
        low = significant_gain(ours, theirs, config.confidence)
        verdict = verdict and low > 0
        reason += f"; {config.confidence:.0%} lower bound of the gain {low:+.4f}, needed > 0"
    return verdict, reason


@task(name="promote")
def promote(
    report: EvalReport,
    candidate: ModelHandle,
    candidate_label: str,
    config: PromotionConfig,
    champion: Champion | None,
    data: PreparedData,
    parent_run_id: str,
) -> PromotionDecision:
    promoted, reason = gate(report, candidate_label, config, champion)
    get_run_logger().info("promotion of %s: %s (%s)", candidate_label, "accepted" if promoted else "rejected", reason)
    if not promoted:
        client().set_tag(parent_run_id, "alignflow.promotion", f"rejected: {reason}")
        return PromotionDecision(promoted=False, reason=reason)
    name = config.model_name
    try:
        client().get_registered_model(name)
    except MlflowException:
        client().create_registered_model(name, description="Models promoted by the alignflow promotion gate.")
    run_id = candidate.mlflow_run_id
    if run_id is None:
        raise ValueError(f"{candidate_label}: its model has no MLflow run to register it from")
    source = f"{client().get_run(run_id).info.artifact_uri}/model"
    figures = {f"eval.{metric}": f"{value:.6g}" for metric, value in report.rows[candidate_label].items()}
    comparable_with = {TOKENIZER_TAG: candidate.tokenizer_fingerprint}
    if "eval_prompts" in data.token_fingerprints:
        comparable_with[EVAL_PROMPTS_TAG] = data.token_fingerprints["eval_prompts"]
    version = client().create_model_version(
        name,
        source=source,
        run_id=run_id,
        tags=figures | comparable_with | {"alignflow.promotion": reason},
    )
    client().set_registered_model_alias(name, config.alias, version.version)
    client().set_tag(parent_run_id, "alignflow.promotion", f"promoted: {name} version {version.version} ({reason})")
    return PromotionDecision(promoted=True, reason=reason, version=str(version.version))
