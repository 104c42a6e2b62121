"""Standalone evaluation: score any models on one eval spec, the same code the pipeline uses."""

from __future__ import annotations

from prefect import flow

from infra.core.config import EvaluationRequest, ModelConfig, check_compute
from tasks.data import prepare_dataset
from tasks.evaluate import EvalReport, HeldOutRewards, check_suites, evaluate
from tasks.models import resolve_model, resolve_scorer
from tasks.reference import cache_ref_logps
from tasks.tracking import start_parent_run, tracked_run


@flow(name="alignflow-evaluation", log_prints=True)
def evaluation(request: EvaluationRequest) -> EvalReport:
    """Score each model in ``request.models`` on the same prompts, pairs and seeds."""
    check_compute(request.compute)
    with tracked_run(start_parent_run(request, kind="evaluation")) as parent_run_id:
        models = {
            label: resolve_model(ModelConfig(source=source), stage=label) for label, source in request.models.items()
        }
        tokenizers = {ref.tokenizer_fingerprint for ref in models.values()}
        if len(tokenizers) != 1:
            raise ValueError(f"models {sorted(models)} use different tokenizers; evaluate them in separate requests")
        data = prepare_dataset(request.data, next(iter(models.values())))
        check_suites(request.evaluation, request.data.builtin)  # before any model is scored
        held_out_rewards = None
        if request.reference_model is not None:
            reference = resolve_model(ModelConfig(source=request.reference_model), stage="reference")
            reference_logps = cache_ref_logps(
                data, reference, request.reference, parent_run_id, request.compute, plugins=request.plugins
            )
            held_out_rewards = HeldOutRewards(reference_logps=reference_logps, beta=request.beta)
        report = evaluate(
            models,
            data,
            held_out_rewards,
            request.evaluation,
            parent_run_id,
            request.name,
            compute=request.compute,
            reward_model=resolve_scorer(request.evaluation.reward_model, {}),
            plugins=request.plugins,
            builtin=request.data.builtin,
        )
        print(report.summary())
        return report
