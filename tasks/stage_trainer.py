"""A stage's trainer with the pipeline's callbacks, built and run in this process: by the train
task (:mod:`tasks.train`) for one process, and on every rank of a launched stage
(:mod:`tasks.launched_rank`). This module imports torch and transformers; the train task imports
it only when a stage trains. MLflow is imported only where a run is tracked (rank 0): ~0.9 s of
imports the other ranks skip.
"""

from __future__ import annotations

from pathlib import Path

import datasets
from transformers.trainer_callback import PrinterCallback

from infra.core.stage_io import TrainInputs
from tasks.reference_columns import read_reference_columns
from trainers.catalog import STAGES, ModelSource, StageInputs
from trainers.models.lora import trainable_parameters
from trainers.runtime.callbacks import FiniteGuard, ProgressLineCallback
from trainers.runtime.checkpoints import CheckpointCompletion, EpochEndEvaluation, restore_extra_state, trainer_state
from trainers.sections import TrainingConfig


def stage_inputs(
    stage: str, inputs: TrainInputs, output_dir: str, callbacks: list, policy_from: Path | None = None
) -> StageInputs:
    """Local paths and loaded splits: the prepared splits, with the cached ``ref_*`` columns
    joined onto the preference splits when the stage reads reference log-probs. The policy is
    loaded from ``policy_from`` (a checkpoint) when given; the reference is always the start model."""
    if inputs.reference_logps is not None:
        splits = read_reference_columns(inputs.reference_logps)  # the train task made sure of it
    else:
        splits = datasets.load_from_disk(inputs.data.path)
    start = ModelSource(inputs.policy.path, inputs.policy.revision)
    policy = start if policy_from is None else ModelSource(str(policy_from))
    return StageInputs(
        policy=policy,
        reference=start,
        splits=splits,
        output_dir=output_dir,
        callbacks=callbacks,
        lora=inputs.lora,
        dtype=inputs.compute.dtype,
        mixed_precision=inputs.compute.mixed_precision,
        cpu=inputs.compute.cpu,
        padding_free=inputs.compute.padding_free,
        reward_models={stage: ModelSource(m.path, m.revision) for stage, m in inputs.reward_models.items()},
        teacher=None if inputs.teacher is None else ModelSource(inputs.teacher.path, inputs.teacher.revision),
        chat_template=inputs.data.chat_template,
    )


def log_model_params(run_id: str, trainer, inputs: TrainInputs) -> None:
    from tasks.mlflow_runs import log_new_params

    params = {"model.trainable_parameters": trainable_parameters(trainer.model)}
    if inputs.lora is not None:
        params |= {f"peft.{name}": value for name, value in inputs.lora.flat().items()}
    log_new_params(run_id, params)


# The settings a diverged stage's error names, where its section has them.
DIVERGENCE_SUSPECTS = ("learning_rate", "beta")


def divergence_suspects(stage: str, section: TrainingConfig) -> dict[str, object]:
    return {f"{stage}.{name}": getattr(section, name) for name in DIVERGENCE_SUSPECTS if hasattr(section, name)}


def tracked_trainer(
    stage: str,
    section: TrainingConfig,
    inputs: TrainInputs,
    output_dir: Path,
    run_id: str | None,
    log_checkpoints: str,
    policy_from: Path | None = None,
):
    """The stage's trainer with the pipeline's callbacks: the divergence guard, checkpoint completion, the MLflow
    tracker of ``run_id`` (which then copies complete checkpoints; none for None: a launched stage's
    other ranks), and the progress line."""
    trainer = STAGES[stage].build(section, stage_inputs(stage, inputs, str(output_dir), [], policy_from))
    trainer.add_callback(FiniteGuard(stage, divergence_suspects(stage, section)))
    trainer.add_callback(CheckpointCompletion(trainer))
    if run_id is not None:
        from tasks.trainer_callback import MlflowTrainerCallback

        table = STAGES[stage].completions_table
        trainer.add_callback(MlflowTrainerCallback(run_id, log_checkpoints=log_checkpoints == "all", table=table))
    trainer.remove_callback(PrinterCallback)  # a dict per log; the progress line replaces it
    trainer.add_callback(ProgressLineCallback(stage))
    trainer.add_callback(EpochEndEvaluation(trainer))  # last: it logs, once the others have begun
    return trainer


def train_from(trainer, checkpoint: Path | None, final: Path | None) -> None:
    """Train from ``checkpoint`` (or from the start). When the model is that of ``final``, the last
    step's checkpoint, nothing is trained: the callbacks see a run of no steps left with that
    checkpoint's state, so the MLflow tracker sends what an attempt killed after saving it had not
    delivered (:meth:`tasks.trainer_callback.MlflowTrainerCallback.on_train_begin`)."""
    if final is not None:
        state = trainer_state(final)
        trainer.callback_handler.on_train_begin(trainer.args, state, trainer.control)
        trainer.callback_handler.on_train_end(trainer.args, state, trainer.control)
        return
    if checkpoint is not None:
        restore_extra_state(trainer, checkpoint)
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
