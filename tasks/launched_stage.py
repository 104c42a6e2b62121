"""A training stage that the train task (``tasks/train.py``) runs over several processes:

    python -m accelerate.commands.launch --multi_gpu ... -m tasks.launched_stage <stage folder>/launch/spec.json

Every process builds the in-process path's trainer (:func:`tasks.stage_trainer.tracked_trainer`) from the
spec: rank 0 with the MLflow tracker of the stage's run, the others with nothing that logs.
``trainers.launch`` runs the spec (the plugins, the world-size check, rank 0's ``history.json``);
the train task writes the spec, streams the launch's output into its Prefect logs, and reports a
failed rank's traceback (each rank writes its own to ``error-rank-<N>.json`` beside the spec).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from infra.core.config import ComputeConfig
from infra.core.launching import Finished, run_process_group, stop_with_parent
from tasks.metric_sender import MetricsNotDelivered
from trainers.launch import JOBS, check_world_size
from trainers.launch import main as run_spec_file

PROJECT_ROOT = Path(__file__).resolve().parents[1]

MODULE = "tasks.launched_stage"  # run as `-m` in every process
JOB = "tracked_train"
SPEC_FILE = "spec.json"
TRACEBACK_LINES = 25  # of the failed rank's traceback, in the task's error


class LaunchFailed(RuntimeError):
    """A launched stage failed: the message holds the failed rank's traceback."""


def error_file(launch_dir: Path, rank: int) -> Path:
    return launch_dir / f"error-rank-{rank}.json"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def tracked_stage(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the spec's stage from its checkpoint (or its start) and save the model into ``model_dir``."""
    from pydantic import TypeAdapter

    from tasks.stage_trainer import log_model_params, tracked_trainer, train_from
    from tasks.train import ADAPTER_DIR, TrainInputs
    from trainers.lora import save_stage_model
    from trainers.stages import STAGES

    stage, output_dir = spec["stage"], Path(spec["output_dir"])
    section = STAGES[stage].section.model_validate(spec["section"])
    inputs = TypeAdapter(TrainInputs).validate_python(spec["inputs"])
    run_id = spec["run_id"] if rank() == 0 else None
    checkpoint = Path(spec["checkpoint"]) if spec["checkpoint"] else None
    final = checkpoint if spec["final"] else None
    trainer = tracked_trainer(stage, section, inputs, output_dir, run_id, spec["log_checkpoints"], policy_from=final)
    check_world_size(spec, trainer.accelerator.num_processes)
    if run_id is not None:
        log_model_params(run_id, trainer, inputs)
    train_from(trainer, checkpoint, final)
    save_stage_model(trainer, Path(spec["model_dir"]), output_dir / ADAPTER_DIR)
    return {"world_size": trainer.accelerator.num_processes, "log_history": trainer.state.log_history}


JOBS[JOB] = tracked_stage


def spec_of(
    stage: str,
    section,
    inputs,
    *,
    output_dir: Path,
    model_dir: Path,
    run_id: str,
    log_checkpoints: str,
    checkpoint: Path | None,
    final: bool,
    plugins: tuple[str, ...],
) -> dict[str, Any]:
    """The spec of a launched stage (JSON: paths below the state folder relative to it, as in ``model.json``)."""
    from pydantic import TypeAdapter

    from tasks.train import TrainInputs

    return {
        "job": JOB,
        "stage": stage,
        "section": section.model_dump(mode="json"),
        "inputs": TypeAdapter(TrainInputs).dump_python(inputs, mode="json"),
        "plugins": list(plugins),
        "output_dir": str(output_dir),
        "model_dir": str(model_dir),
        "run_id": run_id,
        "log_checkpoints": log_checkpoints,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "final": final,
        "world_size": inputs.compute.num_processes,
    }


def failed_rank(launch_dir: Path) -> dict[str, Any] | None:
    """The error of the rank that failed first, if any rank wrote one."""
    errors = [json.loads(path.read_text()) for path in launch_dir.glob("error-rank-*.json")]
    return min(errors, key=lambda error: error["time"], default=None)


def failure(stage: str, finished: Finished, launch_dir: Path) -> Exception:
    """The task's error for a launch that exited with ``finished.returncode``: the traceback of the
    rank that failed first (else the launch's last output lines); MetricsNotDelivered as itself."""
    first = failed_rank(launch_dir)
    if first is None:
        detail = "no rank reported an error; the launch's last output:\n" + "\n".join(finished.tail[-TRACEBACK_LINES:])
        return LaunchFailed(f"{stage}: the launch exited with code {finished.returncode}; {detail}")
    lines = first["traceback"].rstrip().splitlines()[-TRACEBACK_LINES:]
    message = f"{stage}: rank {first['rank']} failed ({first['error']}):\n" + "\n".join(lines)
    return MetricsNotDelivered(message) if first["error"] == MetricsNotDelivered.__name__ else LaunchFailed(message)


def launch_stage(spec: dict[str, Any], compute: ComputeConfig, launch_dir: Path) -> None:
    """Run the spec over ``compute``'s processes from ``launch_dir`` (emptied first), its output
    in the task's logs; raise the failed rank's error if it fails."""
    shutil.rmtree(launch_dir, ignore_errors=True)
    launch_dir.mkdir(parents=True)
    (launch_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2))
    command = compute.launch_command(launch_dir / SPEC_FILE, module=MODULE)
    logger = get_run_logger()
    logger.info("%s on %d processes: %s", spec["stage"], compute.num_processes, shlex.join(command))
    for machine in range(1, compute.num_machines):
        other = compute.model_copy(update={"machine_rank": machine}).launch_command(launch_dir / SPEC_FILE, MODULE)
        logger.info("machine %d must run, from the same checkout: %s", machine, shlex.join(other))
    env = os.environ | {"PYTHONUNBUFFERED": "1"}  # each line reaches the logs when it is printed
    finished = run_process_group(command, logger.info, cwd=PROJECT_ROOT, env=env)
    if finished.returncode != 0:
        raise failure(spec["stage"], finished, launch_dir)


def main() -> None:
    stop_with_parent()  # the launcher starts each rank in a session of its own: a SIGKILLed launcher leaves none
    try:
        run_spec_file()
    except BaseException as error:
        report = {"rank": rank(), "time": time.time(), "error": type(error).__name__}
        report["traceback"] = traceback.format_exc()
        if len(sys.argv) == 2:
            error_file(Path(sys.argv[1]).parent, rank()).write_text(json.dumps(report))
        raise


if __name__ == "__main__":
    main()
