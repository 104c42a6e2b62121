"""The progress line printed per logging step instead of the Trainer's log dicts, and the guard
that stops a diverged stage."""

import re
from types import SimpleNamespace

import pytest
import torch

from trainers.runtime.callbacks import FiniteGuard, ProgressLineCallback, duration, progress_line
from trainers.runtime.non_finite import NonFiniteTraining


@pytest.mark.unit
def test_progress_line_shows_the_stage_step_key_metrics_rate_and_eta():
    logs = {"loss": 0.2149, "grad_norm": 1.3, "rewards/accuracies": 0.93125, "learning_rate": 5e-4, "epoch": 1.2}
    line = progress_line("dpo", 120, 345, logs, seconds=57.14, steps_done=120)
    assert line == "dpo 120/345 · loss 0.215 · acc 0.931 · 2.1 it/s · ETA 1:47"
    assert progress_line("grpo", 0, 10, {"reward": 0.5}, seconds=0.0, steps_done=0) == "grpo 0/10 · reward 0.5"


@pytest.mark.unit
@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (59.6, "1:00"), (107, "1:47"), (3600 + 62, "1:01:02")])
def test_durations_are_minutes_and_seconds_then_hours(seconds, text):
    assert duration(seconds) == text


@pytest.mark.unit
def test_the_callback_prints_one_line_per_log_and_a_closing_line(capsys):
    callback = ProgressLineCallback("sft")
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, max_steps=4)
    callback.on_train_begin(None, state, None)
    state.global_step = 2
    callback.on_log(None, state, None, logs={"loss": 1.5})
    state.global_step = 4
    callback.on_log(None, state, None, logs={"train_runtime": 0.1, "train_loss": 1.2})
    callback.on_log(None, SimpleNamespace(is_world_process_zero=False, global_step=4, max_steps=4), None, logs={"x": 1})
    first, last = capsys.readouterr().out.splitlines()
    assert first.startswith("sft 2/4 · loss 1.5 · ") and " it/s · ETA " in first
    assert last == "sft done: 4 steps in 0:00"


@pytest.mark.slow
# the session's first MLflow store: its migrations take seconds
def test_checkpoints_reach_mlflow_only_when_asked(tmp_path):
    from tasks.mlflow_runs import client, experiment_id
    from tasks.trainer_callback import MlflowTrainerCallback

    run_id = client().create_run(experiment_id("callbacks")).info.run_id
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(is_world_process_zero=True, global_step=3)
    MlflowTrainerCallback(run_id, log_checkpoints=False).on_save(args, state, None)
    assert client().list_artifacts(run_id) == []
    MlflowTrainerCallback(run_id).on_save(args, state, None)
    assert [a.path for a in client().list_artifacts(run_id, "checkpoints")] == ["checkpoints/checkpoint-3"]


@pytest.mark.slow
def test_a_resumed_stage_sends_the_logged_steps_its_run_lacks_once():
    """Killed right after checkpoint-3 was saved, before step 3's metrics reached MLflow: the resumed
    attempt starts at step 4, and its checkpoint's log history has step 3."""
    from tasks.mlflow_runs import client, experiment_id, log_metrics
    from tasks.trainer_callback import MlflowTrainerCallback

    run_id = client().create_run(experiment_id("callbacks")).info.run_id
    for step in (1, 2):
        log_metrics(run_id, {"loss": 1.0 / step, "grad_norm": 2.0 * step}, step=step)
    log_metrics(run_id, {"loss": 1.0 / 3}, step=3)  # one of step 3's metrics was delivered before the kill
    history = [{"loss": 1.0 / s, "grad_norm": 2.0 * s, "epoch": 0.25 * s, "step": s} for s in (1, 2, 3)]
    callback = MlflowTrainerCallback(run_id)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3, log_history=history)
    callback.on_train_begin(None, state, None)
    state.global_step = 4
    callback.on_log(None, state, None, logs={"loss": 0.25, "grad_norm": 8.0, "epoch": 1.0})
    callback.on_train_end(None, state, None)
    steps = {
        key: sorted((m.step, m.value) for m in client().get_metric_history(run_id, key))
        for key in ("loss", "grad_norm", "epoch")
    }
    assert steps == {
        "loss": [(1, 1.0), (2, 0.5), (3, 1.0 / 3), (4, 0.25)],
        "grad_norm": [(1, 2.0), (2, 4.0), (3, 6.0), (4, 8.0)],
        "epoch": [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)],
    }


@pytest.mark.unit
def test_the_guard_refuses_a_model_with_a_non_finite_weight_before_it_is_saved():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    guard = FiniteGuard("dpo", {"dpo.learning_rate": 5e-7, "dpo.beta": 0.1})
    state = SimpleNamespace(global_step=12)
    guard.on_train_end(None, state, None, model=model)  # finite: nothing to say
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    message = (
        "dpo diverged at step 12: weight 1.bias holds nan or inf values (lower the learning rate or the loss's "
        "scale: dpo.learning_rate=5e-07, dpo.beta=0.1); nothing of it is kept"
    )
    with pytest.raises(NonFiniteTraining, match=f"^{re.escape(message)}$"):
        guard.on_train_end(None, state, None, model=model)
    guard.on_log(None, state, None, logs={"loss": 0.5, "grad_norm": float("inf")})  # fp16 overflow steps: not a loss
    with pytest.raises(NonFiniteTraining, match="^dpo diverged at step 12: the eval loss is inf"):
        guard.on_log(None, state, None, logs={"eval_loss": float("inf")})
