"""Checkpoints a killed stage can resume from: marked complete only once every file is written.

The ``Trainer`` writes a checkpoint's files one after another into ``checkpoint-<step>/``; a
process killed in between leaves a folder that looks like a checkpoint but is not one. After the
``Trainer`` is done with a checkpoint (``on_save``), :class:`CheckpointCompletion` adds the state
of the trainer that the ``Trainer`` does not save (``ExtraCheckpointState``: GRPO's generation
buffer, bco_pair's running mean, the metric windows) and then, last, the marker
``checkpoint-complete.json``: the step, and the size and sha256 of every file. Only a checkpoint
whose marker matches its files is resumed from (:func:`latest_complete_checkpoint`): one cut short,
altered at its own size (a disk or a copy gone wrong, an edit) or never finished is removed, with
the file named, and the stage resumes from the checkpoint before it, or from the start. No file is
ever unpickled to find out (``torch.load`` of a broken file fails, at best, with an unpickling error).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME

COMPLETE_MARKER = "checkpoint-complete.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


@runtime_checkable
class ExtraCheckpointState(Protocol):
    """A trainer with state of its own that a resumed run needs (tensors, numbers, lists, dicts)."""

    def checkpoint_state(self) -> dict[str, Any]: ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None: ...


def extra_state_file(checkpoint: Path, process_index: int) -> Path:
    return checkpoint / f"alignflow_state_{process_index}.pt"


def write_atomically(path: Path, content: bytes) -> None:
    """Write beside ``path``, flush to disk, then rename: readers see the old file or the whole new one."""
    staging = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with staging.open("wb") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_records(folder: Path) -> dict[str, dict[str, int | str]]:
    """``relative path -> {"bytes", "sha256"}`` of every file below ``folder`` except the marker."""
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def mark_complete(checkpoint: Path, step: int) -> None:
    marker = {"step": step, "files": file_records(checkpoint)}
    write_atomically(checkpoint / COMPLETE_MARKER, json.dumps(marker).encode())


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed from, or None: its marker exists, names the folder's
    step, and every file it lists has its recorded size and sha256 (sizes first: they are free)."""
    match = CHECKPOINT_NAME.match(checkpoint.name)
    try:
        marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
        step, files = marker["step"], {name: (r["bytes"], r["sha256"]) for name, r in marker["files"].items()}
    except OSError:
        return f"it has no {COMPLETE_MARKER} (the process writing it stopped)"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its {COMPLETE_MARKER} is unreadable"
    if match is None or step != int(match.group(1)):
        return f"its {COMPLETE_MARKER} is that of step {step}"
    try:
        for name, (size, _) in files.items():
            path = checkpoint / name
            if not path.is_file():
                return f"{name} is missing"
            if (found := path.stat().st_size) != size:
                return f"{name} has {found} bytes, {size} when it was saved"
        changed = next((name for name, (_, digest) in files.items() if file_sha256(checkpoint / name) != digest), None)
    except FileNotFoundError:  # removed while read: a newer checkpoint's rotation deletes this one
        return "its files were removed while they were read"
    return None if changed is None else f"{changed} differs from what was saved (its sha256 is not the marker's)"


def is_complete(checkpoint: Path) -> bool:
    return checkpoint_problem(checkpoint) is None


def checkpoints(output_dir: Path) -> list[Path]:
    """``checkpoint-<step>`` folders below ``output_dir``, newest step first."""
    steps = {
        p: match for p in output_dir.glob("checkpoint-*") if p.is_dir() and (match := CHECKPOINT_NAME.match(p.name))
    }
    return sorted(steps, key=lambda p: int(steps[p].group(1)), reverse=True)


def latest_complete_checkpoint(output_dir: Path) -> Path | None:
    return next((c for c in checkpoints(output_dir) if is_complete(c)), None)


def trainer_state(checkpoint: Path) -> TrainerState:
    """The ``Trainer``'s state as the checkpoint saved it (step, log history, …)."""
    return TrainerState.load_from_json(str(checkpoint / TRAINER_STATE_NAME))


def training_done(checkpoint: Path) -> bool:
    """Whether the checkpoint is of the last step (its ``global_step`` reached ``max_steps``)."""
    state = trainer_state(checkpoint)
    return state.global_step >= state.max_steps


def discard_incomplete_checkpoints(output_dir: Path) -> dict[Path, str]:
    """Remove the checkpoint folders that cannot be resumed from (half-written by a killed process,
    or changed since), each with why: they would be retrained and written again anyway, and the
    ``Trainer``'s rotation must not count them. Every checkpoint left is complete."""
    removed = {}
    for checkpoint in checkpoints(output_dir):
        if (problem := checkpoint_problem(checkpoint)) is not None:
            removed[checkpoint] = problem
            shutil.rmtree(checkpoint, ignore_errors=True)
    return removed


class CheckpointCompletion(TrainerCallback):
    """After the ``Trainer`` saved ``checkpoint-<step>``: every process writes its trainer's extra
    state, and once all have, the main process writes the completion marker. Register it before
    callbacks that copy checkpoints elsewhere (they then copy complete ones)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not checkpoint.is_dir():
            return
        if isinstance(self.trainer, ExtraCheckpointState):
            buffer = io.BytesIO()
            torch.save(self.trainer.checkpoint_state(), buffer)
            write_atomically(extra_state_file(checkpoint, args.process_index), buffer.getvalue())
        self.trainer.accelerator.wait_for_everyone()
        if state.is_world_process_zero:
            mark_complete(checkpoint, state.global_step)


class EpochEndEvaluation(TrainerCallback):
    """With ``eval_strategy: epoch``, the ``Trainer`` saves a checkpoint due at an epoch's last step
    in that step and evaluates after it, at the epoch's end; a run resumed from that checkpoint
    starts in the next epoch and never runs the evaluation. So at the start of a resumed run whose
    step ends an epoch and whose log history has no evaluation at that step, evaluate: the metrics
    are those the uninterrupted run logged at that step (the weights are the checkpoint's, training's
    random state is restored after this)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        step = state.global_step
        # (a replay of a finished stage's callbacks passes its checkpoint's state, not the trainer's: no evaluation)
        if (
            state is not self.trainer.state
            or step == 0
            or args.eval_strategy != "epoch"
            or not self.trainer.eval_dataset
        ):
            return
        # the Trainer's epoch counter is whole exactly at an epoch's last step (epoch + steps / steps_in_epoch)
        evaluated = any(
            entry["step"] == step and any(k.startswith("eval_") for k in entry) for entry in state.log_history
        )
        if float(state.epoch).is_integer() and not evaluated:
            self.trainer.evaluate()


def restore_extra_state(trainer: Trainer, checkpoint: Path) -> None:
    """Load what :class:`CheckpointCompletion` saved into ``trainer`` (before ``trainer.train``)."""
    if isinstance(trainer, ExtraCheckpointState):
        trainer.load_checkpoint_state(
            torch.load(extra_state_file(checkpoint, trainer.args.process_index), weights_only=True)
        )
