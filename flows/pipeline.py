"""The experiment flow: prepare → the configured stages (e.g. SFT → reference log-probs → DPO → GRPO)
→ evaluate → promote."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext

from infra.core.config import ExperimentConfig, check_compute, merge_onto
from infra.core.handles import ModelHandle, PreparedData, ReferenceLogps
from infra.core.stage_io import TrainInputs
from tasks.data import check_generations, prepare_dataset
from tasks.evaluate import EvalReport, HeldOutRewards, check_suites, evaluate
from tasks.models import resolve_model, resolve_scorer, resolve_teacher
from tasks.promote import find_champion, promote
from tasks.reference import cache_ref_logps
from tasks.tracking import link_stage, start_parent_run, tracked_run
from tasks.train import train
from trainers.catalog import STAGES
from trainers.scoring.reference_views import HELD_OUT_PAIRS_VIEW, PAIRS_VIEW


@runtime_checkable
class ImplicitRewardScale(Protocol):
    """A section trained on cached reference log-probs (``StageSpec.needs_reference_logps``): its
    ``beta`` scales its implicit rewards."""

    beta: float


def deployment_default_config() -> dict | None:
    """The default ``config`` of the deployment this flow run belongs to; None outside one.
    (``prefect.runtime.deployment.parameters`` are the run's own parameters, not the defaults;
    ``prefect.runtime.deployment.id`` reads the flow run from the API again: 0.4 s on a new server.)"""
    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context is not None and context.flow_run is not None else None
    if deployment_id is None:
        return None
    with get_client(sync_client=True) as client:
        return client.read_deployment(deployment_id).parameters.get("config")


@flow(name="alignflow-experiment", log_prints=True)
def experiment(
    config: ExperimentConfig = ExperimentConfig(),  # noqa: B008 (the UI form's defaults)
    nest_under: str | None = None,
) -> EvalReport:
    """Train a policy with the configured stages and compare every stage's model. In a run of a
    deployment, a partial ``config`` is merged onto the deployment's default config. The MLflow run
    nests under the MLflow run ``nest_under`` when given (a sweep's trial under the sweep's run)."""
    if defaults := deployment_default_config():
        config = merge_onto(config, defaults)
    # before any run is started: a setting this machine cannot run fails here; the train task launches processes
    check_compute(config.compute)
    with tracked_run(start_parent_run(config, parent_run_id=nest_under)) as parent_run_id:
        base = resolve_model(config.model)
        data = prepare_dataset(config.data, base)
        check_generations(config, data)  # before any stage trains
        check_suites(config.evaluation, config.data.builtin)
        models = {"base": base}
        reward_models: dict[str, ModelHandle] = {}
        policy, held_out_rewards = base, None
        for stage in config.stages:
            spec, section = STAGES[stage], config.stage(stage)
            # A stage's reference is the model it starts from; its log-probs are cached once per content.
            reference_logps = None
            if spec.needs_reference_logps(section):
                reference_logps = cache_ref_logps(
                    data, policy, config.reference, parent_run_id, config.compute, spec.reference_view, config.plugins
                )
                if (pairs := held_out_pairs(reference_logps, config, data, policy, parent_run_id)) is not None:
                    if not isinstance(section, ImplicitRewardScale):
                        raise TypeError(f"{stage} trains on reference log-probs, but its section has no beta")
                    held_out_rewards = HeldOutRewards(reference_logps=pairs, beta=section.beta)
            scorers = {name: reward_models[name] for name in spec.reward_models(section) if name in reward_models}
            teacher = resolve_teacher(spec.teacher(section))
            lora = config.peft.for_stage(stage)
            inputs = TrainInputs(
                policy, data, reference_logps, lora, config.compute, reward_models=scorers, teacher=teacher
            )
            trained = train(stage, section, inputs, parent_run_id, config.name, config.tracking, config.plugins)
            link_stage(parent_run_id, stage, trained.mlflow_run_id)
            if spec.produces == "reward_model":  # a scorer for later stages; the policy passes it by
                reward_models[stage] = trained
            else:
                policy = models[stage] = trained
        scorer = resolve_scorer(config.evaluation.reward_model, reward_models)
        return evaluate_and_gate(config, models, policy, data, held_out_rewards, parent_run_id, scorer)


def held_out_pairs(
    reference_logps: ReferenceLogps,
    config: ExperimentConfig,
    data: PreparedData,
    policy: ModelHandle,
    parent_run_id: str,
) -> ReferenceLogps | None:
    """The reference log-probs of the held-out pairs, which the evaluation's implicit rewards read:
    the stage's own entry when it scores the pairs (DPO), else a pass over the held-out pairs alone
    (KTO's entry holds its own rows); None without held-out pairs."""
    if reference_logps.view == PAIRS_VIEW.name:
        return reference_logps
    if "preference_eval" not in data.rows:
        return None
    view = HELD_OUT_PAIRS_VIEW.name
    return cache_ref_logps(data, policy, config.reference, parent_run_id, config.compute, view, config.plugins)


def evaluate_and_gate(
    config: ExperimentConfig,
    models: dict[str, ModelHandle],
    policy: ModelHandle,
    data: PreparedData,
    held_out_rewards: HeldOutRewards | None,
    parent_run_id: str,
    reward_model: ModelHandle | None = None,
) -> EvalReport:
    """Evaluate ``models`` (and, with the promotion gate on, the current champion beside them, on
    the same prompts and seeds), then pass ``policy``, the final stage's model, to the gate."""
    champion = find_champion(config.promotion, policy, data) if config.promotion.registered_model else None
    if champion is not None:
        models = models | champion.models()
    final = config.stages[-1]
    report = evaluate(
        models,
        data,
        held_out_rewards,
        config.evaluation,
        parent_run_id,
        config.name,
        final,
        config.compute,
        reward_model,
        config.plugins,
        config.data.builtin,
    )
    print(report.summary())
    if config.promotion.registered_model:
        decision = promote(report, policy, final, config.promotion, champion, data, parent_run_id)
        print(f"Promotion: {'accepted' if decision.promoted else 'rejected'} ({decision.reason})")
    return report
