"""The experiment flow: prepare → the configured stages (e.g. SFT → reference log-probs → DPO → GRPO) → evaluate → promote."""

from __future__ import annotations

from prefect import flow

from infra.config import ExperimentConfig, ModelConfig
from tasks.data import prepare_dataset
from tasks.evaluate import EvalReport, evaluate
from tasks.models import resolve_model
from tasks.promote import CHAMPION_LABEL, champion_source, promote
from tasks.reference import cache_ref_logps
from tasks.tracking import link_stage, start_parent_run, tracked_run
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
                ref_logps = cache_ref_logps(data, reference, config.reference, parent_run_id)
            policy = train(stage, config, StageInputs(policy, data, ref_logps, reference), parent_run_id)
            link_stage(parent_run_id, stage, policy.mlflow_run_id)
            models[stage] = policy
        if champion := champion_source(config.promotion):
            models[CHAMPION_LABEL] = resolve_model(ModelConfig(source=champion), stage=CHAMPION_LABEL)
        final = config.stages[-1] if config.stages else "base"
        report = evaluate(models, data, ref_logps, config.evaluation, config.dpo.beta, parent_run_id, config.name, final)
        print(f"Evaluation ({report.num_prompts} held-out prompts, {report.num_pairs} held-out pairs):\n{report.markdown()}")
        if config.promotion.registered_model and config.stages:
            decision = promote(report, policy, final, config.promotion, parent_run_id)
            print(f"Promotion: {'accepted' if decision.promoted else 'rejected'} ({decision.reason})")
        return report
