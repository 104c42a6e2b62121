"""Evaluation of every stage's model on the same held-out prompts, pairs and seeds."""

from __future__ import annotations

import math

import datasets
from prefect import task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from infra.config import EvaluationConfig
from tasks.reference import with_reference_columns
from tasks.refs import ModelRef, PreparedData, RefLogps
from tasks.tracking import client, log_metrics, stage_output_dir, stage_run_id, tracked_run
from trainers.evaluation import GenerationSpec, answer_accuracy, preference_rewards
from trainers.modeling import load_causal_lm

COLUMNS = ("greedy_accuracy", "sampled_accuracy", "rewards/accuracies", "rewards/margins")


class EvalReport(BaseModel):
    rows: dict[str, dict[str, float]]  # stage -> metric -> value (NaN where not defined)
    num_prompts: int
    num_pairs: int
    mlflow_run_id: str

    def markdown(self) -> str:
        header = "| stage | greedy acc | sampled acc | DPO reward acc | DPO margin |\n|---|---|---|---|---|\n"
        cell = lambda v: "—" if math.isnan(v) else f"{v:.3f}"  # noqa: E731
        return header + "".join(f"| {stage} | " + " | ".join(cell(m[c]) for c in COLUMNS) + " |\n" for stage, m in self.rows.items())


def score_model(ref: ModelRef, prompts: list[dict], pairs: list[dict] | None, is_reference: bool, config: EvaluationConfig, beta: float) -> dict[str, float]:
    model, tokenizer = load_causal_lm(ref.path, ref.revision)
    spec = GenerationSpec(config.max_new_tokens, config.num_samples, config.temperature, config.batch_size, config.seed)
    scores = answer_accuracy(model, tokenizer, prompts, spec) if prompts else {}
    # The reference scores itself as exactly 0 margin, which says nothing: leave it blank.
    rewards = preference_rewards(model, tokenizer, pairs, beta, config.batch_size) if pairs and not is_reference else {}
    return {column: scores.get(column, rewards.get(column, math.nan)) for column in COLUMNS}


@task(name="evaluate")
def evaluate(
    models: dict[str, ModelRef],
    data: PreparedData,
    ref_logps: RefLogps | None,
    config: EvaluationConfig,
    beta: float,
    parent_run_id: str,
    config_name: str,
) -> EvalReport:
    prepared = datasets.load_from_disk(data.path)
    prompts = prepared["eval_prompts"].to_list()[: config.num_prompts] if "eval_prompts" in prepared else []
    pairs = None
    if ref_logps is not None:
        ref_splits = with_reference_columns(ref_logps)
        pairs = ref_splits["preference_eval"].to_list() if "preference_eval" in ref_splits else None
    reference_fp = ref_logps.reference_fingerprint if ref_logps else None
    rows = {stage: score_model(ref, prompts, pairs, ref.fingerprint == reference_fp, config, beta) for stage, ref in models.items()}

    run_id = stage_run_id(parent_run_id, "evaluate", stage_output_dir(config_name, "evaluate"))
    report = EvalReport(rows=rows, num_prompts=len(prompts), num_pairs=len(pairs or []), mlflow_run_id=run_id)
    with tracked_run(run_id):
        flat = {f"{stage}/{name}": value for stage, metrics in rows.items() for name, value in metrics.items()}
        log_metrics(run_id, flat)
        log_metrics(parent_run_id, {f"eval/{k}": v for k, v in flat.items()})
        table = {"stage": list(rows), **{c: [rows[s][c] for s in rows] for c in COLUMNS}}
        client().log_table(run_id, data=table, artifact_file="eval_table.json")
        client().log_text(run_id, report.markdown(), "eval_table.md")
    create_table_artifact(
        key="evaluation",
        table=[{"stage": stage, **{c: None if math.isnan(v) else round(v, 4) for c, v in m.items()}} for stage, m in rows.items()],
        description=f"{len(prompts)} held-out prompts, {len(pairs or [])} held-out pairs",
    )
    return report
