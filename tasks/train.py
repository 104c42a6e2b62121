"""Training stages as one Prefect task: a stage's spec builds its trainer from its config section
and its inputs; this task runs it, saves the model and tracks it in MLflow.

A stage's output folder is a function of what its model is a function of (:func:`stage_key`), so
an identical rerun, or a Prefect retry, finds what the attempt before it left: a finished model
(``model/`` and ``model.json``) is reused as it is; otherwise training resumes from the latest
complete checkpoint (``trainers/runtime/checkpoints.py``), in the same MLflow run.

One process trains in this task's process; several (``compute.num_processes`` or
``num_machines`` above 1) run the same trainer under ``accelerate launch`` (a
:class:`~infra.core.stage_io.TrainJob` run by :mod:`tasks.launch`), and this task writes
``model.json`` once the launch succeeded. The
trainer itself is built in :mod:`tasks.stage_trainer`, imported only when a stage trains: a run
whose stages are all finished loads neither torch nor transformers.
"""

from __future__ import annotations

import shutil
import socket
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from prefect import get_run_logger, task

from infra.core.config import TrackingConfig
from infra.core.fingerprints import atomic_directory, code_fingerprint, hash_paths, hash_value
from infra.core.handles import ModelHandle
from infra.core.locks import LocalFileLock
from infra.core.settings import get_settings
from infra.core.stage_io import StageFolder, TrainInputs, TrainJob
from infra.core.storage import prune_checkpoints
from tasks.caching import computed_once
from tasks.generation_server import served_section
from tasks.launch import REPEATING_ERRORS, launch, launched_hosts
from tasks.mlflow_runs import client, log_new_params
from tasks.models import checkpoint_handle, record_adapter_base
from tasks.reference import ensure_entry, log_reference_input
from tasks.results import CACHED_RESULT, checked_cache_key
from tasks.tracking import mark_resumed, stage_run_id, tracked_run
from trainers.catalog import STAGES
from trainers.models.lora import save_stage_model
from trainers.sections import TrainingConfig


def stage_key_inputs(stage: str, section: TrainingConfig, inputs: TrainInputs, plugins: tuple[str, ...] = ()) -> dict:
    """What a stage's model is a function of: its section, the weights and tokenizer it starts from
    (not files that name runs and folders), the data, the reference cache entry it reads, and the
    code that trains it (its stage module with the ``trainers`` code it imports, and the plugins,
    which may define its losses and rewards), and the number of processes it runs on."""
    policy = inputs.policy
    return {
        "section": section.model_dump(mode="json"),
        "policy": [policy.weights_fingerprint or policy.fingerprint, policy.tokenizer_fingerprint],
        "data": inputs.data.fingerprint,
        "reference_logps": inputs.reference_logps.key if inputs.reference_logps is not None else None,
        "lora": inputs.lora.model_dump(mode="json") if inputs.lora else None,
        "precision": [inputs.compute.dtype, inputs.compute.mixed_precision],
        "code": code_fingerprint(STAGES[stage].build.__module__, *plugins),
        # the global batch is per-device × processes; absent for one process, so its keys stay as they were
        **({"num_processes": inputs.compute.num_processes} if inputs.compute.multi_process else {}),
        # the reward models it may score with (absent without any, so other keys stay as they were)
        **(
            {"reward_models": {k: m.fingerprint for k, m in inputs.reward_models.items()}}
            if inputs.reward_models
            else {}
        ),
        # a distillation stage's teacher: its weights and tokenizer
        **(
            {
                "teacher": [
                    inputs.teacher.weights_fingerprint or inputs.teacher.fingerprint,
                    inputs.teacher.tokenizer_fingerprint,
                ]
            }
            if inputs.teacher is not None
            else {}
        ),
    }


def stage_key(stage: str, section: TrainingConfig, inputs: TrainInputs, plugins: tuple[str, ...] = ()) -> str:
    return hash_value(stage_key_inputs(stage, section, inputs, plugins))


def train_cache_key(context, parameters) -> str | None:
    """Only cacheable stages are cached by Prefect (across configs: the key has no config name);
    every stage is reused from its output folder (:func:`finished_model`). ``parameters`` holds every
    argument of the call, defaults applied (Prefect binds them so)."""
    spec = STAGES[parameters["stage"]]
    if not spec.cacheable:
        return None
    plugins = tuple(parameters["plugins"])
    return f"train-{spec.name}-" + stage_key(spec.name, parameters["section"], parameters["inputs"], plugins)


def finished_model(folder: StageFolder) -> ModelHandle | None:
    """The stage's final model if an earlier attempt finished it and its files still match. Whatever
    else is in ``model/`` (a changed model, or one saved by an attempt stopped before ``model.json``)
    is removed, to be saved again from the last checkpoint."""
    try:
        handle = ModelHandle.model_validate_json(folder.finished_file.read_text())
    except FileNotFoundError:
        handle = None
    except ValueError as error:
        get_run_logger().warning("%s is unreadable (%s): the model is saved again", folder.finished_file, error)
        handle = None
    if handle is not None:
        if Path(handle.path).is_dir() and hash_paths(Path(handle.path)) == handle.fingerprint:
            return handle
        get_run_logger().warning("the final model in %s is missing or changed: it is saved again", folder.path)
    folder.finished_file.unlink(missing_ok=True)
    for stale in (folder.model_dir, *folder.model_stagings(), folder.adapter_dir):
        shutil.rmtree(stale, ignore_errors=True)
    return None


def worth_retrying(task, task_run, state) -> bool:
    """A retry resumes a stage that crashed; one that diverged, or whose metrics MLflow could not
    take, would only fail again (and hide why), so it is not retried."""
    return not isinstance(state.result(raise_on_failure=False), tuple(REPEATING_ERRORS.values()))


@task(
    name="train",
    cache_policy=computed_once(checked_cache_key(train_cache_key)),  # concurrent identical runs: once
    **CACHED_RESULT,
    retries=1,  # a retry resumes from the latest complete checkpoint
    retry_condition_fn=worth_retrying,
    task_run_name="train-{stage}",
)
def train(
    stage: str,
    section: TrainingConfig,
    inputs: TrainInputs,
    parent_run_id: str,
    config_name: str,
    tracking: TrackingConfig = TrackingConfig(),  # noqa: B008 (frozen)
    plugins: Sequence[str] = (),
) -> ModelHandle:
    """Train the stage, resume it, or reuse its finished model. ``tracking.log_checkpoints`` says
    which models go to MLflow (``all`` saved checkpoints and the final model, the ``final`` one, or
    ``none``), ``tracking.keep_checkpoints`` whether the checkpoints stay in outputs/ once it finished."""
    folder = StageFolder.of(config_name, stage, stage_key(stage, section, inputs, tuple(plugins)))
    # an identical run training the same stage now: wait for it, then reuse its model
    with LocalFileLock(folder.lock_file, timeout=get_settings().stage_lock_timeout):
        if (finished := finished_model(folder)) is not None:
            reused = (stage, folder.path, finished.mlflow_run_id)
            get_run_logger().info("%s: reusing the finished model in %s (MLflow run %s)", *reused)
            return finished
        return run_stage(stage, section, inputs, parent_run_id, folder, tracking, plugins)


def run_stage(
    stage: str,
    section: TrainingConfig,
    inputs: TrainInputs,
    parent_run_id: str,
    folder: StageFolder,
    tracking: TrackingConfig,
    plugins: Sequence[str] = (),
) -> ModelHandle:
    """Train in ``folder`` from its latest complete checkpoint (or from the start), tracked in
    the stage's MLflow run (the one an earlier attempt created, if any): in this process, or over
    ``inputs.compute``'s processes with ``accelerate launch`` (:func:`tasks.launch.launch`)."""
    resumed = folder.run_id_file.exists()
    run_id = stage_run_id(parent_run_id, stage, folder)
    with tracked_run(run_id):
        track_inputs(run_id, stage, section, inputs)
        start = resume_point(stage, folder)
        if resumed:
            mark_resumed(run_id, parent_run_id, stage, trainer_step(start.checkpoint))
        warn_pure_bf16(stage, inputs)
        # the last step's checkpoint trains nothing: no generation server for it
        serving = served_section(stage, section, folder, run_id) if start.final is None else nullcontext(section)
        with serving as served:
            train_run = StageRun(stage, served, inputs, folder, run_id, tracking.log_checkpoints, start)
            trained = train_run.launched(plugins) if inputs.compute.multi_process else train_run.here()
        handle = record_model(run_id, stage, inputs, folder, tracking, trained)
    return handle


def track_inputs(run_id: str, stage: str, section: TrainingConfig, inputs: TrainInputs) -> None:
    """The stage run's params, and the reference-cache entry it reads: a missing or corrupt entry is
    computed here, once (the trainer, each rank, only reads it)."""
    log_new_params(run_id, stage_params(stage, section, inputs))
    if inputs.reference_logps is not None:
        client().set_tag(run_id, "alignflow.reference_cache_key", inputs.reference_logps.key)
        entry, _ = ensure_entry(inputs.reference_logps, run_id)
        log_reference_input(run_id, entry)


@dataclass(frozen=True)
class ResumePoint:
    """Where a stage's training starts: its newest complete checkpoint (None: from the start), and
    ``final``, that checkpoint when it is the last step's (the model is loaded from it, nothing is
    trained: resumed from it, the Trainer would train one step more when that step ends inside an epoch)."""

    checkpoint: Path | None
    final: Path | None


def resume_point(stage: str, folder: StageFolder) -> ResumePoint:
    """The stage's :class:`ResumePoint`, once the checkpoints that cannot be resumed from are removed."""
    from trainers.runtime.checkpoints import checkpoints, discard_incomplete_checkpoints, training_done

    logger = get_run_logger()
    for removed, problem in discard_incomplete_checkpoints(folder.path).items():
        logger.warning("%s: removed %s, which cannot be resumed from: %s", stage, removed, problem)
    checkpoint = next(iter(checkpoints(folder.path)), None)  # the newest; those left are complete
    final = checkpoint if checkpoint is not None and training_done(checkpoint) else None
    if final is not None:
        logger.info("%s: %s is the last step: saving its model", stage, final)
    elif checkpoint is not None:
        logger.info("%s: resuming from %s", stage, checkpoint)
    return ResumePoint(checkpoint, final)


def warn_pure_bf16(stage: str, inputs: TrainInputs) -> None:
    if inputs.compute.trains_pure_bf16 and inputs.lora is None:
        get_run_logger().warning(
            "%s: compute.dtype bfloat16 without mixed_precision trains pure bf16 weights: AdamW updates below "
            "bf16's resolution round away. For mixed precision: compute.dtype float32 and mixed_precision bf16",
            stage,
        )


@dataclass(frozen=True)
class Trained:
    """Where a stage trained (its machines, in machine order) and its LoRA adapter's folder (None without)."""

    hosts: list[str]
    adapter: Path | None


@dataclass(frozen=True)
class StageRun:
    """One training of a stage into ``folder.model_dir``, from ``start``, tracked in ``run_id``."""

    stage: str
    section: TrainingConfig  # as its trainer gets it (with a started generation server's address)
    inputs: TrainInputs
    folder: StageFolder
    run_id: str
    log_checkpoints: Literal["all", "final", "none"]
    start: ResumePoint

    def here(self) -> Trained:
        """In this process."""
        from tasks import stage_trainer

        trainer = stage_trainer.tracked_trainer(
            self.stage,
            self.section,
            self.inputs,
            self.folder.path,
            self.run_id,
            self.log_checkpoints,
            policy_from=self.start.final,
        )
        stage_trainer.log_model_params(self.run_id, trainer, self.inputs)
        stage_trainer.train_from(trainer, self.start.checkpoint, self.start.final)
        with atomic_directory(self.folder.model_dir) as staging:
            adapter = save_stage_model(trainer, staging, self.folder.adapter_dir)
        return Trained([socket.gethostname()], adapter)

    def launched(self, plugins: Sequence[str]) -> Trained:
        """Over ``inputs.compute``'s processes and machines (a :class:`TrainJob` under ``accelerate launch``)."""
        with atomic_directory(self.folder.model_dir) as staging:
            spec = TrainJob(
                plugins=tuple(plugins),
                launch_dir=self.folder.launch_dir,
                stage=self.stage,
                section=self.section,
                inputs=self.inputs,
                folder=self.folder,
                model_dir=staging,
                run_id=self.run_id,
                log_checkpoints=self.log_checkpoints,
                checkpoint=self.start.checkpoint,
                final=self.start.final is not None,
            )
            launch(spec, self.stage)
        return Trained(launched_hosts(spec), self.folder.adapter_dir if self.inputs.lora is not None else None)


def record_model(
    run_id: str, stage: str, inputs: TrainInputs, folder: StageFolder, tracking: TrackingConfig, trained: Trained
) -> ModelHandle:
    """The trained model's handle: where it ran (tags), its adapter's base, its MLflow artifacts,
    then ``model.json`` (last: the stage is finished), and the checkpoints pruned unless kept."""
    from trainers.runtime.checkpoints import write_atomically

    client().set_tag(run_id, "alignflow.machines", ",".join(trained.hosts))
    client().set_tag(run_id, "alignflow.processes", str(inputs.compute.num_processes))
    logged = tracking.log_checkpoints != "none"
    handle = checkpoint_handle(
        folder.model_dir, stage, mlflow_run_id=run_id, source=f"runs:/{run_id}/model" if logged else None
    )
    if trained.adapter is not None:
        record_adapter_base(trained.adapter, inputs.policy)
    if logged:
        client().log_artifacts(run_id, handle.path, "model")
        if trained.adapter is not None:
            client().log_artifacts(run_id, str(trained.adapter), "adapter")
    write_atomically(folder.finished_file, handle.model_dump_json(indent=2).encode())
    if not tracking.keep_checkpoints:
        prune_checkpoints(folder)  # only resuming an unfinished stage reads them
    return handle


def stage_params(stage: str, section: TrainingConfig, inputs: TrainInputs) -> dict:
    """The stage run's MLflow params: its section, where it starts from, its data and what truncation dropped."""
    data = inputs.data
    return {
        **{f"{stage}.{name}": value for name, value in section.model_dump().items()},
        "policy.init": inputs.policy.path,
        **{f"reward_models.{name}": model.path for name, model in inputs.reward_models.items()},
        **({"teacher.path": inputs.teacher.path} if inputs.teacher is not None else {}),
        "data.fingerprint": data.fingerprint,
        # the lengths the data was cut to (`auto` in the config resolves to these)
        **{f"data.{name}": value for name, value in data.truncation.items() if name != "mode"},
        **{f"data.dropped.{split}": count for split, count in data.dropped.items()},
        **{f"data.truncated_prompts.{split}": count for split, count in data.truncated_prompts.items()},
        **{f"data.truncated_completions.{split}": count for split, count in data.truncated_completions.items()},
    }


def trainer_step(checkpoint: Path | None) -> int:
    return int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint is not None else 0
