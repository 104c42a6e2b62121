"""Stage builders: each registered stage's trainer gets exactly its config section's values."""

from enum import Enum

import pytest
from helpers import model_with_context
from prefect.logging import disable_run_logger

from infra.core.config import AdditionTaskConfig, DataConfig, DatasetSource, ReferenceConfig, load_config
from infra.core.stage_io import TrainInputs
from tasks.data import prepare_dataset
from tasks.models import checkpoint_handle
from tasks.reference import cache_ref_logps
from tasks.stage_trainer import stage_inputs
from trainers.catalog import STAGES
from trainers.runtime.callbacks import SyncReferenceCallback

pytestmark = pytest.mark.slow  # training: seconds a test

# Section fields whose TrainingArguments field has another name (the one mapping's translations).
ARGUMENT_NAMES = {"warmup_ratio": "warmup_steps"}


@pytest.fixture(scope="module")
def handles(tiny_checkpoint, tmp_path_factory):
    """(This module's, instead of the session's.) A real prepared dataset, with a held-out split for
    every stage that evaluates, and a real reference-cache entry for it per reference view (the tiny
    model is the reference). The tiny model's config names 512 positions here, not 128: every
    section's defaults must fit it (distill's 128 new tokens after a prompt would not)."""
    policy = checkpoint_handle(
        model_with_context(tiny_checkpoint.path, tmp_path_factory.mktemp("tiny-512") / "model", 512), "base"
    )
    sft_eval = tmp_path_factory.mktemp("stages") / "sft_eval.jsonl"
    sft_eval.write_text('{"prompt": "1+2=", "completion": "3"}\n{"prompt": "2+2=", "completion": "4"}\n')
    config = DataConfig(
        builtin=AdditionTaskConfig(max_operand=3, num_eval_problems=4), sft_eval=DatasetSource(path=str(sft_eval))
    )
    with disable_run_logger():
        data = prepare_dataset.fn(config, policy)
        reference_logps = {
            view: cache_ref_logps.fn(data, policy, ReferenceConfig(batch_size=16), view=view)
            for view in ("pairs", "kto")
        }
    return policy, data, reference_logps


def build(stage, section, handles, tmp_path):
    """The stage's trainer, on the reference-cache entry of its view when its section reads one."""
    policy, data, reference_logps = handles
    spec = STAGES[stage]
    logps = reference_logps[spec.reference_view] if spec.needs_reference_logps(section) else None
    # the tiny model also teaches the stages that distil (the others read no teacher)
    inputs = TrainInputs(policy, data, logps, teacher=policy)
    return STAGES[stage].build(section, stage_inputs(stage, inputs, str(tmp_path), []))


def argument_value(value):
    return value.value if isinstance(value, Enum) else value


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_section_field_reaches_the_trainer_arguments_unchanged(stage, handles, tmp_path):
    """No second default anywhere: the trainer's arguments hold the section's default of every field."""
    section = STAGES[stage].section()
    args = build(stage, section, handles, tmp_path).args
    for name, value in section.model_dump().items():
        assert argument_value(getattr(args, ARGUMENT_NAMES.get(name, name))) == value, name
    assert args.save_strategy == "no" and args.output_dir == str(tmp_path)


def test_cached_reference_stage_reads_columns_and_maps_loss_options(handles, tmp_path):
    overrides = [
        "dpo.loss_type=[sigmoid, sft]",
        "dpo.loss_weights=[1.0, 0.3]",
        "dpo.label_smoothing=0.1",
        "dpo.beta=0.2",
        "dpo.save_steps=5",
        "dpo.warmup_ratio=0.1",
    ]
    section = load_config(None, overrides).dpo
    assert STAGES["dpo"].needs_reference_logps(section)
    trainer = build("dpo", section, handles, tmp_path)
    args = trainer.args
    assert (args.loss_type, args.loss_weights, args.label_smoothing, args.beta) == (
        ["sigmoid", "sft"],
        [1.0, 0.3],
        0.1,
        0.2,
    )
    assert (args.save_strategy, args.save_steps, args.warmup_steps) == ("steps", 5, 0.1)
    assert trainer.ref_model is None and args.reference == "cached" and not args.sync_ref_model
    assert "ref_chosen_logps" in trainer.train_dataset.column_names


def test_live_reference_stage_with_sync(handles, tmp_path):
    overrides = [
        "dpo.reference=live",
        "dpo.sync_ref_model=true",
        "dpo.ref_model_mixup_alpha=0.3",
        "dpo.ref_model_sync_steps=7",
    ]
    section = load_config(None, overrides).dpo
    assert not STAGES["dpo"].needs_reference_logps(section)
    trainer = build("dpo", section, handles, tmp_path)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    (sync,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, SyncReferenceCallback)]
    assert (sync.alpha, sync.sync_steps, sync.ref_model) == (0.3, 7, trainer.ref_model)


def test_reference_free_stage_loads_no_reference(handles, tmp_path):
    section = load_config(None, ["dpo.reference=none"]).dpo
    assert not STAGES["dpo"].needs_reference_logps(section)
    trainer = build("dpo", section, handles, tmp_path)
    assert trainer.args.reference == "none" and trainer.ref_model is None
    assert "ref_chosen_logps" not in trainer.train_dataset.column_names


@pytest.mark.parametrize("loss_type", ["simpo", "cpo", "orpo", "sft", "[simpo, sft]"])
def test_reference_free_objective_needs_no_reference_logps_under_the_default_cached_reference(
    loss_type, handles, tmp_path
):
    """The objective declares it needs no reference: the flow builds no reference cache for it and
    the trainer reads none, though ``reference`` keeps its default ``cached``."""
    section = load_config(None, [f"dpo.loss_type={loss_type}"]).dpo
    assert section.reference == "cached" and section.reference_source() == "none"
    assert not STAGES["dpo"].needs_reference_logps(section)
    trainer = build("dpo", section, handles, tmp_path)
    assert trainer.ref_model is None and trainer.reference_mode == "none"
    assert "ref_chosen_logps" not in trainer.train_dataset.column_names


def test_an_objective_with_a_reference_still_needs_the_cache():
    for overrides in (["dpo.loss_type=[simpo, sigmoid]"], ["dpo.loss_type=aot"], ["dpo.loss_type=f_divergence"]):
        assert STAGES["dpo"].needs_reference_logps(load_config(None, overrides).dpo), overrides


def test_grpo_loads_its_kl_anchor_only_with_a_kl_term(handles, tmp_path):
    assert build("grpo", load_config(None).grpo, handles, tmp_path).ref_model is None
    anchored = build("grpo", load_config(None, ["grpo.beta=0.1"]).grpo, handles, tmp_path)
    assert anchored.ref_model is not None and anchored.ref_model is not anchored.model
