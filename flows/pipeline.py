"""The experiment flow: prepare → the configured stages (e.g. SFT → reference log-probs → DPO → GRPO) → evaluate."""

from __future__ import annotations

from prefect import flow

from infra.config import ExperimentConfig
from tasks.data import prepare_dataset
from tasks.evaluate import EvalReport, evaluate
from tasks.models import resolve_model
from tasks.reference import cache_ref_logps
from tasks.tracking import start_parent_run, tracked_run
from tasks.train import StageInputs, train


@flow(name="alignflow-experiment", log_prints=True)
def experiment(config: ExperimentConfig = ExperimentConfig()) -> EvalReport:
    """Train a policy with the configured stages and compare every stage's model."""
    with tracked_run(start_parent_run(config)) as parent_run_id:
        base = resolve_model(config.model)
        data = prepare_dataset(config.data, base)
        models = {"base": base}
        policy, ref_logps = base, None
        for stage in config.stages:
            reference = policy  # DPO's reference (and GRPO's KL anchor) is the model the stage starts from
            if stage == "dpo" and config.dpo.reference == "cached":
                ref_logps = cache_ref_logps(data, reference, config.reference)
            policy = train(stage, config, StageInputs(policy, data, ref_logps, reference), parent_run_id)
            models[stage] = policy
        report = evaluate(models, data, ref_logps, config.evaluation, config.dpo.beta, parent_run_id, config.name)
        print(f"Evaluation of every stage ({report.num_prompts} held-out prompts, {report.num_pairs} held-out pairs):\n{report.markdown()}")
        return report
