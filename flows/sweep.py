"""The sweep flow: trials of one experiment on a Dask cluster, searched by Optuna, tracked as one
MLflow sweep run with each trial's experiment run nested under it, compared at the end."""

from __future__ import annotations

import logging
from typing import Any, cast

from prefect import State, flow, get_run_logger, task
from prefect.client.schemas.objects import FlowRun
from prefect.concurrency.sync import concurrency
from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner
from pydantic import BaseModel

from flows.pipeline import evaluate_and_gate, experiment
from infra.core.config import ExperimentConfig
from infra.core.handles import ModelHandle
from infra.core.settings import get_settings
from infra.core.stage_io import StageFolder
from infra.core.sweep import SweepConfig
from tasks.compare import ComparisonReport, RunSelection, compare_runs
from tasks.data import prepare_dataset
from tasks.evaluate import EvalReport
from tasks.mlflow_runs import client
from tasks.models import checkpoint_handle, resolve_model, resolve_scorer
from tasks.search import PlannedTrial, Search, plan, sweep_errors
from tasks.sweep import (
    TrialResult,
    check_deployment,
    fail_lost_attempts,
    final_metrics,
    log_sweep,
    trial_run_id,
    trial_slots,
)
from tasks.tracking import start_parent_run, tracked_run


class SweepReport(BaseModel):
    sweep_run_id: str
    trials: list[TrialResult]
    best: TrialResult | None
    table: str
    seed_table: str
    comparison: ComparisonReport | None = None


def launch_experiment(config: ExperimentConfig, sweep_run_id: str, deployment: str | None) -> State:
    """The trial's experiment flow run, to its end: here (on the Dask worker running the trial), or
    as a run of ``deployment`` on its work pool's workers, with the whole config as its parameter
    (so no field falls back to the deployment's defaults)."""
    if deployment is None:
        return experiment(config, nest_under=sweep_run_id, return_state=True)
    parameters = {"config": config.model_dump(mode="json"), "nest_under": sweep_run_id}
    # called from sync code: the flow run itself (async_dispatch's return type covers async callers too)
    run = cast(FlowRun, run_deployment(deployment, parameters=parameters, timeout=None))
    if run.state is None:  # with no timeout it returns once the run's state is final
        raise RuntimeError(f"flow run {run.id} of {deployment} has no state")
    return run.state


def failure(state: State) -> str:
    """What failed the run: its exception when the result is at hand, else the state's message."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # a remote run's result may not be retrievable here
        error = None
    return f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(state.message)


def trial(
    number: int,
    params: dict[str, Any],
    config: ExperimentConfig,
    sweep_run_id: str,
    slots: str,
    deployment: str | None = None,
) -> TrialResult:
    """One trial: an experiment flow run nested under the sweep's MLflow run, holding one of the
    sweep's concurrency slots while it runs. A failing experiment is a failed trial, not a failed task."""
    with concurrency(slots, occupy=1, strict=True):
        lost = fail_lost_attempts(config.tracking.experiment_name, sweep_run_id, config.run_name)
        state = launch_experiment(config, sweep_run_id, deployment)
    flow_run_id = str(state.state_details.flow_run_id)
    run_id = trial_run_id(config.tracking.experiment_name, sweep_run_id, flow_run_id)
    if run_id is not None:
        client().set_tag(run_id, "alignflow.trial", str(number))
    result = TrialResult(
        number=number, params=params, status="failed", mlflow_run_id=run_id, flow_run_id=flow_run_id, lost_attempts=lost
    )
    if not state.is_completed():
        return result.model_copy(update={"error": failure(state)})
    if run_id is None:
        raise RuntimeError(f"trial {number}: its completed flow run {flow_run_id} has no MLflow run under the sweep's")
    return result.model_copy(update={"status": "completed", "metrics": final_metrics(run_id)})


# Made from the plain function rather than with @task: Dask pickles the task, and a function that
# is a module attribute pickles by reference (a decorated one would be pickled by value, globals and all).
run_trial = task(name="trial", task_run_name="trial-{number}")(trial)


def task_runner(spec: SweepConfig) -> TaskRunner:
    """A temporary LocalCluster of ``workers`` single-trial processes, or the scheduler at ``address``;
    with ``deployment``, threads that wait on the work pool's flow runs."""
    if spec.deployment:
        return ThreadPoolTaskRunner(max_workers=spec.max_concurrent)
    if spec.address:
        return DaskTaskRunner(address=spec.address)
    scratch = str(get_settings().root / "dask")  # not /tmp/dask-scratch-space: the scheduler's too
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": spec.workers,
            "threads_per_worker": 1,
            "processes": True,
            "dashboard_address": ":0",  # any free port: 8787 may be taken
            "silence_logs": logging.WARNING,
            "env": {"OMP_NUM_THREADS": str(spec.torch_threads)},
            "local_directory": scratch,
            "scheduler_kwargs": {"local_directory": scratch},
        }
    )


def invalid(trial: PlannedTrial) -> TrialResult:
    return TrialResult(number=trial.number, params=trial.params, status="invalid", error="; ".join(trial.errors))


def run_trials(spec: SweepConfig, search: Search, planned: list[PlannedTrial], sweep_run_id: str) -> list[TrialResult]:
    """Submit the trials to the Dask runner and tell Optuna each result as it comes. A planned
    search submits every trial at once (the concurrency limit and the workers pace them); an
    adaptive one keeps ``max_concurrent`` in flight and asks for the next when one finishes."""
    logger = get_run_logger()
    queue = list(planned)
    results: list[TrialResult] = []
    in_flight: dict[PrefectFuture[Any], PlannedTrial] = {}
    window = spec.trial_count if planned else spec.max_concurrent

    def next_trial() -> PlannedTrial | None:
        if queue:
            return queue.pop(0)
        return search.ask() if search.adaptive and len(results) + len(in_flight) < spec.trial_count else None

    with trial_slots(f"alignflow-sweep-{flow_run.get_id()}", spec.max_concurrent) as slots, task_runner(spec) as runner:
        while True:
            while len(in_flight) < window and (trial := next_trial()) is not None:
                if trial.errors:  # an adaptive proposal whose config is invalid: reported, never run
                    results.append(invalid(trial))
                    search.tell(trial.number, None)
                    continue
                config = spec.trial_config(trial.params, trial.number)
                parameters = {"number": trial.number, "params": trial.params, "config": config}
                parameters |= {"sweep_run_id": sweep_run_id, "slots": slots, "deployment": spec.deployment}
                future = runner.submit(run_trial, parameters)
                in_flight[future] = trial
            if not in_flight:
                return results
            done = next(as_completed(list(in_flight)))
            trial = in_flight.pop(done)
            outcome = done.result(raise_on_failure=False)
            if not isinstance(outcome, TrialResult):  # the task itself failed (e.g. its worker died)
                error = f"{type(outcome).__name__}: {outcome}"
                outcome = TrialResult(number=trial.number, params=trial.params, status="failed", error=error)
            search.tell(trial.number, outcome.objective(spec.objective.metric))
            logger.info("trial %d (%s): %s", trial.number, trial.label, outcome.error or outcome.status)
            results.append(outcome)


def promote_best(spec: SweepConfig, best: TrialResult, sweep_run_id: str) -> EvalReport:
    """The best trial's final model through the base config's promotion gate: scored beside the
    current champion (same prompts, same seeds) in an evaluation logged under the sweep's run, by
    the trial's evaluation reward model too (its reward stage's model, or a saved one) when it names one."""
    config = spec.trial_config(best.params, best.number, gate=True)
    data = prepare_dataset(config.data, resolve_model(config.model))
    final = config.stages[-1]
    policy = trial_model(config, final, best)
    scorer_name = config.evaluation.reward_model
    trained = {}
    if scorer_name is not None and scorer_name in config.stages:
        trained[scorer_name] = trial_model(config, scorer_name, best)
    scorer = resolve_scorer(scorer_name, trained)
    return evaluate_and_gate(config, {final: policy}, policy, data, None, sweep_run_id, scorer)


def trial_model(config: ExperimentConfig, stage: str, trial: TrialResult) -> ModelHandle:
    """The model ``stage`` of ``trial``'s experiment run ended with: the stage folder of the MLflow
    run that trained it (a cached stage's is an earlier run's)."""
    if trial.mlflow_run_id is None:
        raise ValueError(f"trial {trial.number} has no MLflow run to take its {stage} model from")
    trained_by = client().get_run(trial.mlflow_run_id).data.tags[f"alignflow.{stage}_run_id"]
    model = StageFolder.of_run(config.name, stage, trained_by).model_dir
    return checkpoint_handle(model, stage, mlflow_run_id=trained_by)


@flow(name="alignflow-sweep", log_prints=True)
def sweep(spec: SweepConfig) -> SweepReport:
    """Run the sweep's trials (each an experiment flow run) on a Dask cluster, bounded by a Prefect
    concurrency limit of ``max_concurrent``; then log the trials, the seed-aggregated table and the
    best trial on the sweep's MLflow run, and compare the completed trials. Every planned trial's
    config is validated before anything starts; a trial that fails at run time fails alone."""
    search, planned = plan(spec)
    if errors := sweep_errors(spec, planned):
        raise ValueError("invalid sweep: " + "; ".join(errors))
    if spec.deployment:
        check_deployment(spec.deployment)
    # The sweep run creates the MLflow store and experiment before any trial runs: processes that
    # create a fresh SQLite store at once race on its schema.
    with tracked_run(start_parent_run(spec, kind="sweep")) as sweep_run_id:
        trials = run_trials(spec, search, planned, sweep_run_id)
        table, seed_table, best = log_sweep(spec, trials, sweep_run_id)
        completed = tuple(t.mlflow_run_id for t in trials if t.status == "completed" and t.mlflow_run_id is not None)
        comparison = None
        if completed:
            selection = RunSelection(runs=completed)
            comparison = compare_runs(spec.tracking.experiment_name, params=list(spec.space), selection=selection)
            client().log_artifacts(sweep_run_id, comparison.folder, "comparison")
        print(f"{table}\nOver seeds (mean ± sd):\n{seed_table}")
        if spec.promote and best is not None:
            promote_best(spec, best, sweep_run_id)
        return SweepReport(
            sweep_run_id=sweep_run_id,
            trials=trials,
            best=best,
            table=table,
            seed_table=seed_table,
            comparison=comparison,
        )
