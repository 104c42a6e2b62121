"""Trainer callbacks: the TR-DPO reference sync, the guard against a diverged stage, and the
progress line the pipeline prints."""

from __future__ import annotations

import math
import time
from typing import Mapping

import torch
from transformers import TrainerCallback
from transformers.modeling_utils import unwrap_model

from trainers.runtime.non_finite import NonFiniteTraining
from trainers.runtime.parameter_sharding import SHARDINGS, ParameterSharding


@torch.no_grad()
def mix_into_reference(
    reference: torch.nn.Module, policy: torch.nn.Module, alpha: float, sharding: ParameterSharding | None = None
) -> None:
    """``ref ← α·θ + (1 − α)·ref`` for every parameter, matched by name; the policy's parameters
    are gathered whole first when ``sharding`` (that of the prepared policy) shards them."""
    sharding = sharding or SHARDINGS["replicated"]
    reference_params = dict(unwrap_model(reference).named_parameters())
    with sharding.full_parameters(policy) as policy_params:
        if reference_params.keys() != policy_params.keys():
            missing = sorted(reference_params.keys() ^ policy_params.keys())[:5]
            raise ValueError(f"reference and policy parameters differ (e.g. {missing}); cannot sync the reference")
        for name, param in policy_params.items():
            target = reference_params[name]
            target.lerp_(param.to(target.device, target.dtype), alpha)


class SyncReferenceCallback(TrainerCallback):
    """TR-DPO soft reference update (Gorbatovski et al., 2024, arXiv:2404.09656): after every
    ``sync_steps`` optimizer steps, ``ref ← α·θ + (1 − α)·ref`` on the live reference model (whole
    on every process, see trainers/runtime/parameter_sharding.py), the policy gathered per ``sharding``."""

    def __init__(
        self, ref_model: torch.nn.Module, alpha: float, sync_steps: int, sharding: ParameterSharding | None = None
    ):
        self.ref_model = ref_model
        self.alpha = alpha
        self.sync_steps = sync_steps
        self.sharding = sharding

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.sync_steps == 0:
            mix_into_reference(self.ref_model, model, self.alpha, self.sharding)


class FiniteGuard(TrainerCallback):
    """Stops a stage as soon as a logged loss is ``nan`` or ``inf``, and before its model is saved
    when a weight is: a diverged model is never saved as a stage's result. The error names the
    stage, the step and ``suspects``, the settings that most often make a run diverge (e.g.
    ``{"dpo.learning_rate": 5e-7, "dpo.beta": 0.1}``).

    Needs ``logging_nan_inf_filter=False``: with the ``Trainer``'s default, a non-finite step loss is
    replaced by the mean of the ones before it, and a run whose every step is ``nan`` logs loss 0."""

    LOSSES = ("loss", "eval_loss", "train_loss")

    def __init__(self, stage: str, suspects: Mapping[str, object]):
        self.stage = stage
        self.suspects = dict(suspects)

    def failure(self, what: str, step: int) -> NonFiniteTraining:
        settings = ", ".join(f"{name}={value}" for name, value in self.suspects.items())
        hint = f" (lower the learning rate or the loss's scale: {settings})" if settings else ""
        return NonFiniteTraining(f"{self.stage} diverged at step {step}: {what}{hint}; nothing of it is kept")

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in self.LOSSES:
            value = (logs or {}).get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise self.failure(f"the {key.replace('_', ' ')} is {value}", state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        with torch.no_grad():
            broken = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
        if broken is not None:
            raise self.failure(f"weight {broken} holds nan or inf values", state.global_step)


# What a progress line shows of the Trainer's logs, in this order (the full logs go to the tracker).
PROGRESS_FIELDS = {
    "loss": "loss",
    "rewards/accuracies": "acc",
    "reward": "reward",
    "eval_loss": "eval loss",
    "eval_rewards/accuracies": "eval acc",
}


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


def progress_line(
    stage: str, step: int, max_steps: int, logs: dict[str, float], seconds: float, steps_done: int
) -> str:
    """``dpo 120/345 · loss 0.21 · acc 0.93 · 2.1 it/s · ETA 1:47``: one line per logging step;
    ``steps_done`` optimizer steps took ``seconds`` (the rate and the ETA come from them)."""
    parts = [f"{stage} {step}/{max_steps}"]
    parts += [f"{label} {logs[key]:.3g}" for key, label in PROGRESS_FIELDS.items() if key in logs]
    if steps_done > 0 and seconds > 0:
        rate = steps_done / seconds
        parts.append(f"{rate:.3g} it/s")
        parts.append(f"ETA {duration(max(max_steps - step, 0) / rate)}")
    return " · ".join(parts)


class ProgressLineCallback(TrainerCallback):
    """Prints a compact progress line per logging step (rank 0), and the wall time at the end; use
    it instead of the Trainer's ``PrinterCallback``, which prints every log as a dict."""

    def __init__(self, stage: str):
        self.stage = stage
        self.started, self.first_step = 0.0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.first_step = time.perf_counter(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        seconds = time.perf_counter() - self.started
        if "train_runtime" in logs:
            print(f"{self.stage} done: {state.global_step} steps in {duration(seconds)}")
        else:
            steps = state.global_step - self.first_step
            print(progress_line(self.stage, state.global_step, state.max_steps, logs, seconds, steps))
