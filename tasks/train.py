"""Training stages as one Prefect task: a stage's spec builds its trainer from its config section
and its inputs; this task runs it, saves the model and tracks it in MLflow."""

from __future__ import annotations

from dataclasses import dataclass

import datasets
from prefect import task
from transformers.trainer_callback import PrinterCallback

from infra.config import ComputeConfig, TrackingConfig
from tasks.fingerprints import code_fingerprint, hash_value
from tasks.handles import ModelHandle, PreparedData, ReferenceLogps
from tasks.models import checkpoint_handle
from tasks.reference import log_reference_input, with_reference_columns
from tasks.storage import prune_checkpoints
from tasks.tracking import client, log_params, stage_output_dir, stage_run_id, tracked_run
from tasks.trainer_callback import MlflowTrainerCallback
from trainers.callbacks import ProgressLineCallback
from trainers.lora import LoraSettings, save_stage_model, trainable_parameters
from trainers.sections import TrainingConfig
from trainers.stages import STAGES, ModelSource, StageInputs


@dataclass(frozen=True)
class TrainInputs:
    """A stage's inputs as handles: the model it starts from (also its reference), the prepared
    data and, for a stage that reads them, the reference log-prob cache entry."""

    policy: ModelHandle
    data: PreparedData
    reference_logps: ReferenceLogps | None = None
    lora: LoraSettings | None = None  # train LoRA adapters (``peft.for_stage``) instead of every weight
    compute: ComputeConfig = ComputeConfig()  # noqa: RUF009 (frozen): load dtype and mixed precision


def stage_inputs(stage: str, inputs: TrainInputs, output_dir: str, callbacks: list) -> StageInputs:
    """Local paths and loaded splits: the prepared splits, with the cached ``ref_*`` columns
    joined onto the preference splits when the stage reads reference log-probs."""
    if inputs.reference_logps is not None:
        splits = with_reference_columns(inputs.reference_logps)
    else:
        splits = datasets.load_from_disk(inputs.data.path)
    start = ModelSource(inputs.policy.path, inputs.policy.revision)
    return StageInputs(
        policy=start,
        reference=start,
        splits=splits,
        output_dir=output_dir,
        callbacks=callbacks,
        lora=inputs.lora,
        dtype=inputs.compute.dtype,
        mixed_precision=inputs.compute.mixed_precision,
        cpu=inputs.compute.cpu,
    )


def train_cache_key(context, parameters) -> str | None:
    """Only cacheable stages: their model is a function of the section, the input model, the data
    and the code that trains it."""
    spec = STAGES[parameters["stage"]]
    if not spec.cacheable:
        return None
    inputs: TrainInputs = parameters["inputs"]
    key_inputs = {
        "section": parameters["section"].model_dump(mode="json"),
        "policy": inputs.policy.fingerprint,
        "data": inputs.data.fingerprint,
        "lora": inputs.lora.model_dump(mode="json") if inputs.lora else None,
        "precision": [inputs.compute.dtype, inputs.compute.mixed_precision],
        "code": code_fingerprint(spec.build.__module__),
    }
    return f"train-{spec.name}-" + hash_value(key_inputs)


@task(name="train", cache_key_fn=train_cache_key, persist_result=True, task_run_name="train-{stage}")
def train(
    stage: str,
    section: TrainingConfig,
    inputs: TrainInputs,
    parent_run_id: str,
    config_name: str,
    tracking: TrackingConfig = TrackingConfig(),  # noqa: B008 (frozen)
) -> ModelHandle:
    """Train the stage; ``tracking.log_checkpoints`` says which models go to MLflow (``all`` saved
    checkpoints and the final model, the ``final`` one, or ``none``) and ``tracking.keep_checkpoints``
    whether the intermediate checkpoints stay in outputs/ once the final model is saved."""
    spec = STAGES[stage]
    output_dir = stage_output_dir(config_name, stage)
    run_id = stage_run_id(parent_run_id, stage, output_dir)
    with tracked_run(run_id):
        log_params(run_id, {f"{stage}.{name}": value for name, value in section.model_dump().items()})
        log_params(run_id, {"policy.init": inputs.policy.path, "data.fingerprint": inputs.data.fingerprint})
        log_params(run_id, {f"data.dropped.{split}": count for split, count in inputs.data.dropped.items()})
        truncated = inputs.data.truncated_prompts
        log_params(run_id, {f"data.truncated_prompts.{split}": count for split, count in truncated.items()})
        if inputs.reference_logps is not None:
            client().set_tag(run_id, "alignflow.reference_cache_key", inputs.reference_logps.key)
        tracker = MlflowTrainerCallback(run_id, log_checkpoints=tracking.log_checkpoints == "all")
        built = stage_inputs(stage, inputs, str(output_dir), [tracker])
        trainer = spec.build(section, built)
        log_params(run_id, {"model.trainable_parameters": trainable_parameters(trainer.model)})
        if inputs.lora is not None:
            log_params(run_id, {f"peft.{name}": value for name, value in inputs.lora.flat().items()})
        trainer.remove_callback(PrinterCallback)  # a dict per log; the progress line replaces it
        trainer.add_callback(ProgressLineCallback(stage))
        if inputs.reference_logps is not None:
            log_reference_input(run_id, inputs.reference_logps)  # after building: a corrupt entry is rebuilt by then
        trainer.train()
        model_dir = output_dir / "model"  # with LoRA: the merged copy, and the adapter in output_dir/adapter
        adapter_dir = save_stage_model(trainer, model_dir, output_dir / "adapter")
        if tracking.log_checkpoints != "none":
            client().log_artifacts(run_id, str(model_dir), "model")
            if adapter_dir is not None:
                client().log_artifacts(run_id, str(adapter_dir), "adapter")
        if not tracking.keep_checkpoints:
            prune_checkpoints(output_dir)
    return checkpoint_handle(model_dir, stage, mlflow_run_id=run_id)
