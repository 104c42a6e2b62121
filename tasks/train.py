"""Training stages (SFT, DPO, GRPO) as one Prefect task; the config → trainer-arguments mapping lives here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets
import torch
from prefect import task
from transformers import Trainer, TrainingArguments

from infra.config import DPOStageConfig, ExperimentConfig, GRPOStageConfig, TrainingConfig
from tasks.fingerprints import hash_value
from tasks.models import checkpoint_ref
from tasks.reference import log_reference_input, with_reference_columns
from tasks.refs import ModelRef, PreparedData, RefLogps
from tasks.tracking import MlflowTrainerCallback, client, log_params, stage_output_dir, stage_run_id, tracked_run
from trainers.collators import CompletionOnlyCollator, PreferenceCollator
from trainers.dpo import DPOConfig, DPOTrainer
from trainers.grpo import GRPOConfig, GRPOTrainer
from trainers.modeling import load_causal_lm

TRAIN_CODE_VERSION = "train-v1"


def common_arguments(config: TrainingConfig, output_dir: Path) -> dict:
    """The one place where experiment config becomes ``TrainingArguments``."""
    return dict(
        output_dir=str(output_dir),
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        per_device_eval_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_ratio,  # a float below 1 is a fraction of the total steps
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        logging_steps=config.logging_steps,
        save_strategy="steps" if config.save_steps else "no",
        save_steps=config.save_steps or 500,
        save_total_limit=2,
        seed=config.seed,
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


@dataclass(frozen=True)
class StageInputs:
    policy: ModelRef
    data: PreparedData
    ref_logps: RefLogps | None
    reference: ModelRef | None


def build_sft(config: ExperimentConfig, inputs: StageInputs, output_dir: Path, callbacks: list) -> Trainer:
    model, tokenizer = load_causal_lm(inputs.policy.path, inputs.policy.revision)
    return Trainer(
        model=model,
        args=TrainingArguments(**common_arguments(config.sft, output_dir)),
        train_dataset=datasets.load_from_disk(inputs.data.path)["sft"],
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def build_dpo(config: ExperimentConfig, inputs: StageInputs, output_dir: Path, callbacks: list) -> Trainer:
    stage: DPOStageConfig = config.dpo
    model, tokenizer = load_causal_lm(inputs.policy.path, inputs.policy.revision)
    ref_model = load_causal_lm(inputs.reference.path, inputs.reference.revision)[0] if stage.reference == "live" else None
    # Cached reference log-probs are joined onto the pairs as columns; otherwise read the plain pairs.
    splits = with_reference_columns(inputs.ref_logps) if inputs.ref_logps is not None else datasets.load_from_disk(inputs.data.path)
    eval_split = splits["preference_eval"] if "preference_eval" in splits else None
    args = DPOConfig(
        **common_arguments(stage, output_dir),
        beta=stage.beta,
        loss_type=stage.loss_type,
        loss_weights=stage.loss_weights,
        label_smoothing=stage.label_smoothing,
        discopop_tau=stage.discopop_tau,
        reference_free=stage.reference == "none",
        sync_ref_model=stage.sync_ref_model,
        ref_model_mixup_alpha=stage.ref_model_mixup_alpha,
        ref_model_sync_steps=stage.ref_model_sync_steps,
        eval_strategy="epoch" if eval_split is not None else "no",
    )
    return DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=splits["preference"],
        eval_dataset=eval_split,
        data_collator=PreferenceCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def build_grpo(config: ExperimentConfig, inputs: StageInputs, output_dir: Path, callbacks: list) -> Trainer:
    stage: GRPOStageConfig = config.grpo
    model, tokenizer = load_causal_lm(inputs.policy.path, inputs.policy.revision)
    # The KL anchor is the policy GRPO starts from; with β = 0 no reference is loaded at all.
    ref_model = load_causal_lm(inputs.reference.path, inputs.reference.revision)[0] if stage.beta > 0 else None
    grpo_fields = set(GRPOStageConfig.model_fields) - set(TrainingConfig.model_fields)
    args = GRPOConfig(**common_arguments(stage, output_dir), **stage.model_dump(include=grpo_fields))
    return GRPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.load_from_disk(inputs.data.path)["grpo_prompts"],
        processing_class=tokenizer,
        callbacks=callbacks,
    )


STAGE_BUILDERS: dict[str, Callable[..., Trainer]] = {"sft": build_sft, "dpo": build_dpo, "grpo": build_grpo}
# Stages whose output is a pure function of their inputs and cached across flow runs; the
# SFT model is the DPO reference, so caching it keeps the reference log-prob cache warm.
CACHED_STAGES = {"sft"}


def train_cache_key(context, parameters) -> str | None:
    stage = parameters["stage"]
    if stage not in CACHED_STAGES:
        return None
    config: ExperimentConfig = parameters["config"]
    inputs: StageInputs = parameters["inputs"]
    return f"train-{stage}-" + hash_value(
        {"stage": getattr(config, stage).model_dump(), "policy": inputs.policy.fingerprint, "data": inputs.data.fingerprint, "code": TRAIN_CODE_VERSION}
    )


@task(name="train", cache_key_fn=train_cache_key, persist_result=True, task_run_name="train-{stage}")
def train(stage: str, config: ExperimentConfig, inputs: StageInputs, parent_run_id: str) -> ModelRef:
    output_dir = stage_output_dir(config.name, stage)
    run_id = stage_run_id(parent_run_id, stage, output_dir)
    with tracked_run(run_id):
        log_params(run_id, {f"{stage}.{k}": v for k, v in getattr(config, stage).model_dump().items()})
        log_params(run_id, {"policy.init": inputs.policy.path, "data.fingerprint": inputs.data.fingerprint})
        log_params(run_id, {f"data.dropped.{split}": count for split, count in inputs.data.dropped.items()})
        if inputs.ref_logps is not None:
            client().set_tag(run_id, "alignflow.reference_cache_key", inputs.ref_logps.key)
        trainer = STAGE_BUILDERS[stage](config, inputs, output_dir, [MlflowTrainerCallback(run_id)])
        if inputs.ref_logps is not None:
            log_reference_input(run_id, inputs.ref_logps)  # after building: a corrupt entry is rebuilt by then
        trainer.train()
        model_dir = output_dir / "model"
        trainer.save_model(str(model_dir))
        client().log_artifacts(run_id, str(model_dir), "model")
    return checkpoint_ref(model_dir, stage, mlflow_run_id=run_id)
