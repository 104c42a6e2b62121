"""One training stage in every process of an ``accelerate launch``, from a JSON spec.

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 -m trainers.launch spec.json

The spec names the stage, its section's fields, the ``plugins`` to import first, the checkpoint it
starts from, the prepared splits (a ``save_to_disk`` folder; DPO's preference split with its
``ref_*`` columns), the output folder, the compute settings, and the number of processes the run
must have: a launch that silently ran fewer (``accelerate launch --cpu --num_processes 2`` starts one) fails. Rank 0
writes ``history.json`` (the Trainer's log history and the world size) and ``model/``.
:func:`launch_command` builds the command from a ``compute`` section.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HISTORY_FILE = "history.json"


def launch_command(compute: Any, spec_path: str | Path, module: str = "trainers.launch") -> list[str]:
    """The ``accelerate launch`` command of ``compute`` (a ``ComputeConfig``) running ``module spec_path``.

    Several processes are launched as ``--multi_gpu`` even on the CPU: ``--cpu`` with
    ``--num_processes 2`` starts one process (accelerate 1.15); the stage itself asks for the
    CPU (``use_cpu``) and its processes talk over gloo. An ``accelerate_config`` file (FSDP,
    DeepSpeed) sets the distributed type; the compute section's counts override its own."""
    from infra.config import accelerate_config_path

    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if compute.accelerate_config:
        command += ["--config_file", str(accelerate_config_path(compute.accelerate_config))]
    elif compute.multi_process:
        command += ["--multi_gpu"]
    command += [
        "--num_processes",
        str(compute.num_processes),
        "--num_machines",
        str(compute.num_machines),
        "--machine_rank",
        str(compute.machine_rank),
        "--main_process_port",
        str(compute.main_process_port),
        "--mixed_precision",
        compute.mixed_precision,
        "--dynamo_backend",
        "no",
    ]
    if compute.main_process_ip:
        command += ["--main_process_ip", compute.main_process_ip]
    return command + ["-m", module, str(spec_path)]


def run_spec(spec: dict[str, Any]) -> None:
    import importlib

    import datasets

    from trainers.rewards import allow_module
    from trainers.stages import STAGES, ModelSource, StageInputs

    for module in spec.get("plugins", []):  # as the config's plugins: rewards they define may be named
        importlib.import_module(module)
        allow_module(module)
    stage = STAGES[spec["stage"]]
    section = stage.section(**spec.get("section", {}))
    start = ModelSource(spec["model"])
    compute = spec.get("compute", {})
    output_dir = Path(spec["output_dir"])
    inputs = StageInputs(
        policy=start,
        reference=start,
        splits=datasets.load_from_disk(spec["splits"]),
        output_dir=str(output_dir),
        dtype=compute.get("dtype", "auto"),
        mixed_precision=compute.get("mixed_precision", "no"),
        cpu=compute.get("cpu", False),
    )
    trainer = stage.build(section, inputs)
    world_size = trainer.accelerator.num_processes
    expected = spec.get("world_size")
    if expected is not None and world_size != expected:
        raise SystemExit(
            f"trainers.launch: the spec asks for {expected} processes, this run has {world_size}: "
            "check the launch command (`--cpu --num_processes N` starts one process)"
        )
    trainer.train()
    trainer.save_model(str(output_dir / "model"))
    if trainer.is_world_process_zero():
        history = {"world_size": world_size, "log_history": trainer.state.log_history}
        (output_dir / HISTORY_FILE).write_text(json.dumps(history))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: accelerate launch ... -m trainers.launch SPEC.json")
    run_spec(json.loads(Path(args[0]).read_text()))


if __name__ == "__main__":
    main()
