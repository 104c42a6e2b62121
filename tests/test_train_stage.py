"""The pipeline's DPO stage builder: every DPO option of the config reaches the trainer."""

import pytest
from prefect.logging import disable_run_logger

from infra.config import AdditionTaskConfig, DataConfig, ReferenceConfig, load_config
from tasks.data import prepare_dataset
from tasks.models import checkpoint_ref
from tasks.reference import cache_ref_logps
from tasks.train import StageInputs, build_dpo
from trainers.callbacks import SyncReferenceCallback


@pytest.fixture(scope="module")
def stage_inputs(tiny, tmp_path_factory):
    """A real prepared dataset and a real reference-cache entry for it (the tiny model is the reference)."""
    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("dpo-stage")
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    policy = checkpoint_ref(root / "model", "sft")
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=3, num_eval_problems=4)), policy)
        ref_logps = cache_ref_logps.fn(data, policy, ReferenceConfig(batch_size=16))
    return policy, data, ref_logps


def test_cached_reference_stage_reads_columns_and_maps_loss_options(stage_inputs, tmp_path):
    policy, data, ref_logps = stage_inputs
    config = load_config(None, ["dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1.0, 0.3]", "dpo.label_smoothing=0.1",
                                "dpo.beta=0.2", "dpo.discopop_tau=0.1"])
    trainer = build_dpo(config, StageInputs(policy, data, ref_logps, policy), tmp_path, [])
    args = trainer.args
    assert (args.loss_type, args.loss_weights, args.label_smoothing, args.beta, args.discopop_tau) == (["sigmoid", "sft"], [1.0, 0.3], 0.1, 0.2, 0.1)
    assert trainer.ref_model is None and not args.reference_free and not args.sync_ref_model
    assert "ref_chosen_logps" in trainer.train_dataset.column_names


def test_live_reference_stage_with_sync(stage_inputs, tmp_path):
    policy, data, _ = stage_inputs
    config = load_config(None, ["dpo.reference=live", "dpo.sync_ref_model=true", "dpo.ref_model_mixup_alpha=0.3", "dpo.ref_model_sync_steps=7"])
    trainer = build_dpo(config, StageInputs(policy, data, None, policy), tmp_path, [])
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    (sync,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, SyncReferenceCallback)]
    assert (sync.alpha, sync.sync_steps, sync.ref_model) == (0.3, 7, trainer.ref_model)


def test_reference_free_stage_loads_no_reference(stage_inputs, tmp_path):
    policy, data, _ = stage_inputs
    trainer = build_dpo(load_config(None, ["dpo.reference=none"]), StageInputs(policy, data, None, policy), tmp_path, [])
    assert trainer.args.reference_free and trainer.ref_model is None
    assert "ref_chosen_logps" not in trainer.train_dataset.column_names
