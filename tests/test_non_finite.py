"""A stage that diverges fails, naming the stage, the step and the setting to lower, and nothing of
it is kept as finished: no model, no ``model.json``, no checkpoint of a non-finite step, its MLflow
run FAILED. A rerun fails the same way instead of reusing a broken model."""

from __future__ import annotations

import re

import pytest
from prefect.logging import disable_run_logger

from infra.core.config import load_config
from infra.core.stage_io import StageFolder, TrainInputs
from tasks.mlflow_runs import client, experiment_id
from tasks.train import stage_key, train
from trainers.runtime.checkpoints import checkpoints
from trainers.runtime.non_finite import NonFiniteTraining

pytestmark = pytest.mark.slow  # training: seconds a test

DIVERGING = ["stages=[sft]", "sft.learning_rate=1e30", "sft.max_steps=8", "sft.logging_steps=1", "sft.save_steps=1"]


def test_a_diverging_stage_fails_at_its_first_non_finite_loss_and_nothing_is_finished(handles):
    policy, data, _ = handles
    config = load_config(None, [*DIVERGING, "tracking.log_checkpoints=none"])
    inputs = TrainInputs(policy, data)
    parent = client().create_run(experiment_id("diverging")).info.run_id
    suspects = r"\(lower the learning rate or the loss's scale: sft.learning_rate=1e\+30\)"
    pattern = rf"^sft diverged at step (\d+): the loss is nan {suspects}"
    with disable_run_logger(), pytest.raises(NonFiniteTraining) as failed:
        train.fn("sft", config.sft, inputs, parent, "diverging", config.tracking)
    step = int(re.match(pattern, str(failed.value)).group(1))
    folder = StageFolder.of("diverging", "sft", stage_key("sft", config.sft, inputs))
    assert not folder.finished_file.exists() and not folder.model_dir.exists()
    # the steps before the divergence were checkpointed; the diverged step's checkpoint was never written
    assert sorted(int(c.name.split("-")[1]) for c in checkpoints(folder.path)) == [
        s for s in (step - 2, step - 1) if s > 0
    ]
    (run,) = client().search_runs([experiment_id("diverging")], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert run.info.status == "FAILED"
    losses = [m.step for m in client().get_metric_history(run.info.run_id, "loss")]
    assert losses == list(range(1, step))  # every finite loss, and no other

    with disable_run_logger(), pytest.raises(NonFiniteTraining, match=f"^sft diverged at step {step}: the loss is nan"):
        train.fn("sft", config.sft, inputs, parent, "diverging", config.tracking)  # resumes, and fails again
    assert not folder.finished_file.exists()
