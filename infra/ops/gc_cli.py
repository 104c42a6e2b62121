"""``alignflow gc [--older-than AGE] [--keep-last N] [--mlflow-checkpoints] [--dry-run]``: free the space
that no live run and no registry version needs (rules in :mod:`infra.core.storage`)."""

from __future__ import annotations

import argparse
import sys

from infra.core.settings import get_settings

PARENT_TAG = "mlflow.parentRunId"


def add_gc_parser(commands) -> None:
    gc = commands.add_parser(
        "gc",
        help="remove superseded stage outputs and checkpoints",
        description=__doc__,
        epilog="example: alignflow gc --older-than 7d --keep-last 1 --dry-run",
    )
    gc.add_argument(
        "--older-than", default="7d", metavar="AGE", help="only folders untouched this long (default 7d; 0s: any)"
    )
    gc.add_argument(
        "--keep-last", type=int, default=1, metavar="N", help="newest stage folders kept per config and stage (1)"
    )
    gc.add_argument(
        "--mlflow-checkpoints",
        action="store_true",
        help="also delete the MLflow checkpoints/ artifacts of this state folder's finished stage runs (model/ stays)",
    )
    gc.add_argument("--dry-run", action="store_true", help="only print what would be removed")


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def with_checkpoints(client, folders) -> list:
    """The finished stage runs of ``folders`` (this state folder's) whose MLflow artifacts still hold
    ``checkpoints/``: never another state folder's runs on a shared tracking server."""
    runs = [client.get_run(f.run_id) for f in folders if f.status == "FINISHED"]
    return [run for run in runs if any(a.path == "checkpoints" for a in client.list_artifacts(run.info.run_id))]


def gc_command(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException

    from infra.core import mlflow_compat
    from infra.core.refcache import parse_duration
    from infra.core.storage import LIVE_STATUSES, RunFacts, folder_size, plan_removals, remove, stage_folders
    from tasks.mlflow_runs import client

    try:
        older_than = parse_duration(args.older_than)
    except ValueError as error:
        print(f"alignflow gc: {error}", file=sys.stderr)
        return 2
    if args.keep_last < 0:
        print("alignflow gc: --keep-last must be 0 or more", file=sys.stderr)
        return 2

    def describe_run(run_id: str) -> RunFacts:
        try:
            run = client().get_run(run_id)
        except MlflowException:  # deleted, or the folder belongs to another store
            return RunFacts("MISSING")
        return RunFacts(run.info.status, run.data.tags.get("alignflow.stage"), trial_of(run))

    def trial_of(stage_run) -> str | None:
        """The stage's parent run when that is a sweep's trial: nested under the sweep's run."""
        parent_id = stage_run.data.tags.get(PARENT_TAG)
        try:
            parent = client().get_run(parent_id) if parent_id else None
        except MlflowException:
            return None
        return parent_id if parent is not None and PARENT_TAG in parent.data.tags else None

    folders = stage_folders(get_settings().outputs, describe_run)
    removals = plan_removals(folders, older_than, args.keep_last)
    verb = "would remove" if args.dry_run else "removed"
    freed = 0
    for removal in removals:
        size = folder_size(removal.path)
        freed += size
        print(f"{verb} {removal.path} ({human_size(size)}): {removal.reason}")
    if not args.dry_run:
        remove(removals)
    if args.mlflow_checkpoints:
        for run in with_checkpoints(client(), folders):
            print(f"{verb} MLflow checkpoints/ of stage run {run.info.run_id} ({run.info.run_name})")
            if not args.dry_run:
                mlflow_compat.delete_artifacts(run.info.artifact_uri, "checkpoints")
    kept = len(folders) - sum(r.whole_stage for r in removals)
    live = sum(f.status in LIVE_STATUSES for f in folders)
    print(f"{verb} {human_size(freed)} from outputs/; kept {kept} stage folders ({live} live)")
    return 0
