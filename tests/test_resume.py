"""Resuming a stage from a checkpoint (trainers/runtime/checkpoints.py): the weights equal an uninterrupted
run's, with the state the ``Trainer`` does not save (GRPO's generation buffer, bco_pair's running
mean) restored; only checkpoints marked complete are resumed from."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from infra.core.config import load_config
from infra.core.stage_io import TrainInputs
from tasks.stage_trainer import stage_inputs
from trainers.catalog import STAGES
from trainers.runtime.checkpoints import (
    COMPLETE_MARKER,
    CheckpointCompletion,
    EpochEndEvaluation,
    discard_incomplete_checkpoints,
    is_complete,
    latest_complete_checkpoint,
    restore_extra_state,
    training_done,
)

pytestmark = pytest.mark.slow  # training: seconds a test


def build(stage: str, overrides: list[str], handles, output_dir: Path, teacher=None):
    policy, data, reference_logps = handles
    teaching = [f"{stage}.teacher_model={teacher.path}"] if teacher is not None else []
    section = load_config(None, [*overrides, *teaching]).stage(stage)
    spec = STAGES[stage]
    logps = reference_logps[spec.reference_view] if spec.needs_reference_logps(section) else None
    inputs = TrainInputs(policy, data, logps, teacher=teacher)
    trainer = STAGES[stage].build(section, stage_inputs(stage, inputs, str(output_dir), []))
    trainer.add_callback(CheckpointCompletion(trainer))
    return trainer


def train(
    stage, overrides, handles, output_dir, resume_from: Path | None = None, extra_state: bool = True, teacher=None
):
    trainer = build(stage, overrides, handles, output_dir, teacher)
    if resume_from is not None and extra_state:
        restore_extra_state(trainer, resume_from)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    return trainer


def max_difference(a, b) -> float:
    return max(
        (x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def resumed_copy(full_dir: Path, step: int, target: Path) -> Path:
    """A folder holding only ``checkpoint-<step>`` of a finished run: what a kill after that checkpoint leaves."""
    target.mkdir()
    return Path(shutil.copytree(full_dir / f"checkpoint-{step}", target / f"checkpoint-{step}"))


CASES = {
    # bco_pair's δ is the running mean of every training batch's rewards: lost, it restarts at 0
    "dpo-bco_pair": ("dpo", ["dpo.loss_type=bco_pair", "dpo.max_steps=4", "dpo.save_steps=2"], 2),
    # two steps per generation batch: a checkpoint after the first leaves half a batch in the buffer
    "grpo-mid-buffer": (
        "grpo",
        [
            "grpo.max_steps=4",
            "grpo.save_steps=1",
            "grpo.per_device_train_batch_size=8",
            "grpo.num_generations=4",
            "grpo.steps_per_generation=2",
            "grpo.logging_steps=1",
            "grpo.entropy_coef=0.1",  # the untrained model earns no reward: a gradient from what it sampled
        ],
        3,
    ),
    # TR-DPO mixes the policy into the live reference every step: the reference is trained state too
    "dpo-tr-dpo": (
        "dpo",
        [
            "dpo.reference=live",
            "dpo.sync_ref_model=true",
            "dpo.ref_model_sync_steps=1",
            "dpo.max_steps=4",
            "dpo.save_steps=2",
        ],
        2,
    ),
    "sft": ("sft", ["sft.max_steps=4", "sft.save_steps=2", "sft.per_device_train_batch_size=8"], 2),
    # the cached reference log-probs of each batch's completions and KL completions after the resume
    "kto": ("kto", ["kto.max_steps=4", "kto.save_steps=2", "kto.per_device_train_batch_size=8"], 2),
    "kto-live": (
        "kto",
        ["kto.reference=live", "kto.max_steps=4", "kto.save_steps=2", "kto.per_device_train_batch_size=8"],
        2,
    ),
    # a sequence classifier whose score head is fresh at the start: saved in the checkpoint
    "reward": ("reward", ["reward.max_steps=4", "reward.save_steps=2", "reward.per_device_train_batch_size=8"], 2),
    # the student's samples of step 3 (on-policy at λ = 0.5, seed 0; step 2 is not) after the resume
    "distill": (
        "distill",
        [
            "distill.max_steps=4",
            "distill.save_steps=2",
            "distill.per_device_train_batch_size=8",
            "distill.max_new_tokens=8",
        ],
        2,
    ),
    # sequence-level KD: the teacher's samples of steps 2 and 3 after the resume
    "distill-seq_kd": (
        "distill",
        [
            "distill.lmbda=0",
            "distill.seq_kd=true",
            "distill.max_steps=4",
            "distill.save_steps=2",
            "distill.per_device_train_batch_size=8",
            "distill.max_new_tokens=8",
        ],
        2,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_stage_ends_with_the_weights_of_an_uninterrupted_one(case, handles, teacher_checkpoint, tmp_path):
    stage, overrides, step = CASES[case]
    teacher = teacher_checkpoint if stage == "distill" else None
    full = train(stage, overrides, handles, tmp_path / "full", teacher=teacher)
    checkpoint = resumed_copy(tmp_path / "full", step, tmp_path / "resumed")
    assert is_complete(checkpoint)
    resumed = train(stage, overrides, handles, tmp_path / "resumed", resume_from=checkpoint, teacher=teacher)
    assert resumed.state.global_step == full.state.global_step
    assert max_difference(full.model, resumed.model) <= 1e-6


@pytest.mark.parametrize("case", ["dpo-bco_pair", "dpo-tr-dpo", "grpo-mid-buffer"])
def test_without_the_trainers_own_state_the_resumed_weights_differ(case, handles, tmp_path):
    """The test above can fail: the Trainer's checkpoint alone does not give the same weights."""
    stage, overrides, step = CASES[case]
    full = train(stage, overrides, handles, tmp_path / "full")
    checkpoint = resumed_copy(tmp_path / "full", step, tmp_path / "resumed")
    resumed = train(stage, overrides, handles, tmp_path / "resumed", resume_from=checkpoint, extra_state=False)
    assert max_difference(full.model, resumed.model) > 1e-6


def test_the_saved_extra_state_holds_the_half_served_generation_buffer(handles, tmp_path):
    stage, overrides, _ = CASES["grpo-mid-buffer"]
    train(stage, overrides, handles, tmp_path)
    state = torch.load(tmp_path / "checkpoint-3" / "alignflow_state_0.pt", weights_only=True)
    assert state["buffer"]["served"] == 1 and len(state["buffer"]["slices"]) == 2  # one of two slices served
    bco = train("dpo", CASES["dpo-bco_pair"][1], handles, tmp_path / "dpo")
    saved = torch.load(tmp_path / "dpo" / "checkpoint-2" / "alignflow_state_0.pt", weights_only=True)
    assert saved["reward_mean"]["count"] == 2  # two training batches, one δ update each
    assert bco.reward_mean.count == 4


@pytest.mark.parametrize("with_callback", [True, False])
def test_a_run_resumed_from_an_epochs_last_step_runs_that_epochs_evaluation(handles, tmp_path, with_callback):
    """A checkpoint due at an epoch's last step is saved before the epoch's evaluation: resumed from
    it, the run starts in the next epoch. ``EpochEndEvaluation`` runs the missed evaluation first, at
    that step, with the uninterrupted run's values; without it the evaluation is lost."""
    overrides = ["reward.per_device_train_batch_size=8", "reward.logging_steps=1"]
    per_epoch = len(build("reward", overrides, handles, tmp_path / "probe").get_train_dataloader())
    overrides += [f"reward.save_steps={per_epoch}", f"reward.max_steps={2 * per_epoch}"]

    def evaluations(trainer) -> list[tuple[int, float]]:
        return [(entry["step"], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]

    full = train("reward", overrides, handles, tmp_path / "full")
    assert [step for step, _ in evaluations(full)] == [per_epoch, 2 * per_epoch]
    checkpoint = resumed_copy(tmp_path / "full", per_epoch, tmp_path / "resumed")
    resumed = build("reward", overrides, handles, tmp_path / "resumed")
    if with_callback:
        resumed.add_callback(EpochEndEvaluation(resumed))
    restore_extra_state(resumed, checkpoint)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    if with_callback:
        got, want = evaluations(resumed), evaluations(full)
        assert [step for step, _ in got] == [step for step, _ in want]
        assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], abs=1e-6)
    else:
        assert [step for step, _ in evaluations(resumed)] == [2 * per_epoch]


def test_only_complete_checkpoints_are_resumed_from(tmp_path):
    """A marker that lists every file with its size and sha256 is written last; a folder without
    it, with a file cut short, missing or altered at its own size, or whose marker names another
    step, is incomplete and removed before resuming, with why."""

    def checkpoint(step: int, files: dict[str, bytes], marker_of: dict[str, bytes] | None, marker_step=None) -> Path:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for name, content in files.items():
            (folder / name).write_bytes(content)
        if marker_of is not None:
            records = {
                name: {"bytes": len(c), "sha256": hashlib.sha256(c).hexdigest()} for name, c in marker_of.items()
            }
            marker = {"step": marker_step or step, "files": records}
            (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
        return folder

    saved = {"model.safetensors": b"12345", "optimizer.pt": b"abcdef"}
    good = checkpoint(2, saved, saved)
    checkpoint(4, saved | {"model.safetensors": b"123"}, saved)  # cut short
    checkpoint(6, saved, None)  # killed before the marker
    checkpoint(8, saved, saved, marker_step=2)  # a copied marker
    checkpoint(10, saved | {"optimizer.pt": b"abcdeX"}, saved)  # altered at its own size
    checkpoint(12, {"model.safetensors": b"12345"}, saved)  # a file gone
    assert latest_complete_checkpoint(tmp_path) == good
    assert {p.name: why for p, why in discard_incomplete_checkpoints(tmp_path).items()} == {
        "checkpoint-4": "model.safetensors has 3 bytes, 5 when it was saved",
        "checkpoint-6": "it has no checkpoint-complete.json (the process writing it stopped)",
        "checkpoint-8": "its checkpoint-complete.json is that of step 2",
        "checkpoint-10": "optimizer.pt differs from what was saved (its sha256 is not the marker's)",
        "checkpoint-12": "optimizer.pt is missing",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_a_checkpoint_removed_while_it_is_checked_is_incomplete_not_an_error(tmp_path, monkeypatch):
    """A reader (a test polling for a step, `alignflow runs`) may check a folder that the training
    process rotates away meanwhile: the checkpoint is then incomplete, with why."""
    import trainers.runtime.checkpoints as checkpoints

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"12345")
    checkpoints.mark_complete(folder, 4)
    hash_file = checkpoints.file_sha256

    def rotated_away(path: Path) -> str:
        shutil.rmtree(folder)  # the trainer's save_total_limit, between the size check and the hash
        return hash_file(path)

    monkeypatch.setattr(checkpoints, "file_sha256", rotated_away)
    assert checkpoints.checkpoint_problem(folder) == "its files were removed while they were read"
    assert not is_complete(folder)


@pytest.mark.parametrize(
    "case, name",
    [("sft", "optimizer.pt"), ("dpo-bco_pair", "alignflow_state_0.pt")],  # the Trainer's state, and alignflow's
)
def test_a_checkpoint_corrupted_at_its_own_size_falls_back_to_the_one_before_naming_the_file(
    case, name, handles, tmp_path
):
    """Resuming from the checkpoint before gives the weights of an uninterrupted run: the fallback
    loses nothing but the steps since."""
    stage, overrides, _ = CASES[case]
    overrides = [*overrides, f"{stage}.save_steps=1"]  # checkpoints 3 and 4 are kept
    full = train(stage, overrides, handles, tmp_path)
    latest = tmp_path / "checkpoint-4"
    content = bytearray((latest / name).read_bytes())
    content[len(content) // 2] ^= 0xFF
    (latest / name).write_bytes(bytes(content))
    assert discard_incomplete_checkpoints(tmp_path) == {
        latest: f"{name} differs from what was saved (its sha256 is not the marker's)"
    }
    fallback = latest_complete_checkpoint(tmp_path)
    assert fallback == tmp_path / "checkpoint-3"
    resumed = train(stage, overrides, handles, tmp_path, resume_from=fallback)
    assert max_difference(full.model, resumed.model) <= 1e-6


def test_the_marker_is_written_after_the_trainers_files_and_lists_them(handles, tmp_path):
    train(*CASES["sft"][:2], handles, tmp_path)
    marker = json.loads((tmp_path / "checkpoint-4" / COMPLETE_MARKER).read_text())
    assert marker["step"] == 4
    listed = set(marker["files"])
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= listed
    on_disk = {p.name for p in (tmp_path / "checkpoint-4").iterdir()} - {COMPLETE_MARKER}
    assert listed == on_disk


def test_a_resumed_stages_tracker_does_not_log_a_step_its_run_already_has():
    """The killed attempt logged steps 1-3 and checkpointed at 2: the resumed attempt's steps 3 and
    4 arrive again; step 3 is not logged twice, per metric, and neither is its completions table."""
    from types import SimpleNamespace

    from tasks.mlflow_runs import client, experiment_id
    from tasks.trainer_callback import COMPLETIONS_TABLE, MlflowTrainerCallback
    from trainers.grpo.section import COMPLETIONS_LOG_KEY

    experiment = experiment_id("resume-logging")
    run_id = client().create_run(experiment).info.run_id

    def log(callback, step, logs):
        callback.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=step), None, logs=logs)

    table = {"step": [3], "prompt": ["1+1="], "completion": ["2"]}
    first = MlflowTrainerCallback(run_id, table=COMPLETIONS_LOG_KEY)
    for step in (1, 2, 3):
        log(first, step, {"loss": float(step), "reward": 10.0 + step})
    log(first, 3, {COMPLETIONS_LOG_KEY: table})
    first.on_train_end(None, None, None)  # the metric sender delivers what it holds
    resumed = MlflowTrainerCallback(run_id, table=COMPLETIONS_LOG_KEY)
    log(resumed, 3, {"loss": 3.0, "reward": 13.0, COMPLETIONS_LOG_KEY: table})
    log(resumed, 4, {"loss": 4.0, "eval_loss": 0.5})
    resumed.on_train_end(None, None, None)
    assert [(m.step, m.value) for m in client().get_metric_history(run_id, "loss")] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert [m.step for m in client().get_metric_history(run_id, "reward")] == [1, 2, 3]
    assert [m.step for m in client().get_metric_history(run_id, "eval_loss")] == [4]
    rows = client().load_table(experiment, COMPLETIONS_TABLE, run_ids=[run_id])
    assert rows["step"].tolist() == [3]


def test_a_checkpoint_of_the_last_step_is_recognised_as_the_end_of_training(handles, tmp_path):
    train(*CASES["sft"][:2], handles, tmp_path)  # max_steps 4, a checkpoint every 2
    assert training_done(tmp_path / "checkpoint-4") and not training_done(tmp_path / "checkpoint-2")
