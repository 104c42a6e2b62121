"""Storage retention: what a finished stage keeps in ``outputs/``, and what ``alignflow gc`` may remove.

Rules (plain code, no Prefect):
- A finished stage keeps its final model; its intermediate checkpoints (weights plus optimizer
  state, only useful to resume an unfinished stage) are pruned unless ``tracking.keep_checkpoints``.
- ``alignflow gc`` removes stage folders of its own state folder that no live run and no registry
  version needs: a folder whose MLflow run is RUNNING is kept, and so are the newest ``keep_last``
  folders of each (config name, stage), the versions of one config; a sweep's trials share their
  config name but are siblings, not versions, so each trial is a group of its own. The rest go once
  older than the age limit. Registered model versions are
  stored in MLflow's artifact store, never in ``outputs/``, so removing outputs cannot break them;
  a removed stage is retrained (or its cache entry rebuilt) when a run needs it again.
- Optionally the ``checkpoints/`` artifacts in MLflow of the finished stage runs whose folders are
  in this state folder (a tracking server shared by a team holds other folders' runs too);
  ``model/`` always stays.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Iterable

from infra.core.stage_io import StageFolder

LIVE_STATUSES = ("RUNNING", "SCHEDULED")


def prune_checkpoints(folder: StageFolder) -> list[Path]:
    """Remove a finished stage's ``checkpoint-*`` folders; returns what was removed."""
    removed = folder.checkpoints()
    for checkpoint in removed:
        shutil.rmtree(checkpoint)
    return removed


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@dataclass(frozen=True)
class RunFacts:
    """What gc reads of a stage's MLflow run."""

    status: str  # the run's status; "MISSING" when the store no longer knows the run
    stage: str | None = None  # its stage tag (None: the folder's name is used)
    trial_run_id: str | None = None  # the sweep trial's run it belongs to, if it ran in one


@dataclass(frozen=True)
class StageRecord:
    """A stage's output folder, its MLflow run and what decides whether it is still needed."""

    path: Path
    run_id: str
    config_name: str
    stage: str
    status: str  # the MLflow run's status; "MISSING" when the store no longer knows the run
    modified: datetime
    trial_run_id: str | None = None  # a sweep trial's stages are never superseded by another trial's

    @property
    def group(self) -> tuple[str, ...]:
        """The folders that are versions of one another: one config's stage, or one trial's."""
        return (self.config_name, self.stage) + ((self.trial_run_id,) if self.trial_run_id else ())


@dataclass(frozen=True)
class Removal:
    path: Path
    reason: str
    whole_stage: bool  # the stage folder itself, not one of its checkpoints


def stage_folders(outputs: Path, describe_run: Callable[[str], RunFacts]) -> list[StageRecord]:
    """Every folder under ``outputs`` that holds a stage's run-id file; ``describe_run(run_id)``
    reads its MLflow run."""
    found = []
    for stage_folder in StageFolder.under(outputs):
        folder, run_id = stage_folder.path, stage_folder.recorded_run_id()
        if run_id is None:  # its run-id file was removed since it was listed
            continue
        facts = describe_run(run_id)
        newest = max((f.stat().st_mtime for f in folder.rglob("*")), default=folder.stat().st_mtime)
        found.append(
            StageRecord(
                path=folder,
                run_id=run_id,
                config_name=folder.relative_to(outputs).parts[0],
                stage=facts.stage or folder.name,
                status=facts.status,
                modified=datetime.fromtimestamp(newest, timezone.utc),
                trial_run_id=facts.trial_run_id,
            )
        )
    return found


def plan_removals(
    folders: Iterable[StageRecord], older_than: timedelta, keep_last: int, now: datetime | None = None
) -> list[Removal]:
    """Which stage folders go: not live, not among the newest ``keep_last`` of their (config, stage),
    and last modified before ``now - older_than``. Finished folders that stay lose their checkpoints."""
    cutoff = (now or datetime.now(timezone.utc)) - older_than
    by_group: dict[tuple[str, ...], list[StageRecord]] = {}
    for folder in folders:
        by_group.setdefault(folder.group, []).append(folder)
    removals = []
    for group in sorted(by_group):
        # live folders are kept whatever their age and do not count towards keep_last
        settled = [f for f in by_group[group] if f.status not in LIVE_STATUSES]
        for rank, folder in enumerate(sorted(settled, key=lambda f: f.modified, reverse=True)):
            if rank >= keep_last and folder.modified < cutoff:
                reason = f"{folder.status.lower()} run {folder.run_id}, superseded"
                removals.append(Removal(folder.path, reason, whole_stage=True))
            elif folder.status == "FINISHED":
                checkpoints = StageFolder(path=folder.path).checkpoints()
                removals += [Removal(c, "checkpoint of a finished stage", whole_stage=False) for c in checkpoints]
    return removals


def remove(removals: Iterable[Removal]) -> None:
    for removal in removals:
        if removal.path.is_dir():
            shutil.rmtree(removal.path)
