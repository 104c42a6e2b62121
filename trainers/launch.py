"""One training stage (or a sharded reference pass or evaluation) in every process of an
``accelerate launch``, from a JSON spec.

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 -m trainers.launch spec.json

The spec names the ``job``, the stage and its section's fields, the ``plugins`` to import first,
the checkpoint it starts from, the prepared splits (a ``save_to_disk`` folder; DPO's preference
split with its ``ref_*`` columns), the output folder, the compute settings, and the number of
processes the run must have: a launch that silently ran fewer (``accelerate launch --cpu
--num_processes 2`` starts one) fails. Jobs: ``train`` (rank 0 writes ``model/``, and the log
history and world size in ``history.json``), ``reference`` and ``evaluate`` (the reference pass
or the evaluation sharded over the processes; their results in ``history.json``).
``ComputeConfig.launch_command`` (``infra/core/config``) builds the command from a compute section.
``JOBS`` is a registry: a module launched with ``-m`` may add its own job before it calls
:func:`main` (``tasks/launched_stage.py``: a pipeline stage, tracked in MLflow by rank 0).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

HISTORY_FILE = "history.json"


def check_world_size(spec: dict[str, Any], world_size: int) -> None:
    expected = spec.get("world_size")
    if expected is not None and world_size != expected:
        raise SystemExit(
            f"trainers.launch: the spec asks for {expected} processes, this run has {world_size}: "
            "check the launch command (`--cpu --num_processes N` starts one process)"
        )


def import_plugins(modules: list[str]) -> None:
    """As the config's plugins: imported, and the rewards they define may be named."""
    import importlib

    from trainers.rewards import allow_module

    for module in modules:
        importlib.import_module(module)
        allow_module(module)


def train_stage(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the stage; writes ``model/`` and returns the log history."""
    import datasets

    from trainers.stages import STAGES, ModelSource, StageInputs

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
    check_world_size(spec, trainer.accelerator.num_processes)
    trainer.train()
    trainer.save_model(str(output_dir / "model"))
    return {"world_size": trainer.accelerator.num_processes, "log_history": trainer.state.log_history}


def loaded_model(spec: dict[str, Any]):
    """The spec's model on this process's device, in the spec's dtype, and the launch's state."""
    from accelerate import PartialState

    from trainers.modeling import load_causal_lm

    compute = spec.get("compute", {})
    state = PartialState(cpu=compute.get("cpu", False))
    check_world_size(spec, state.num_processes)
    model, tokenizer = load_causal_lm(spec["model"], dtype=compute.get("dtype", "auto"), device=state.device)
    return model, tokenizer, state


def reference_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """Reference log-probs of the ``preference`` split, sharded over the processes."""
    import datasets

    from trainers.reference import reference_logps

    model, tokenizer, state = loaded_model(spec)
    rows = datasets.load_from_disk(spec["splits"])["preference"].to_list()
    chosen, rejected = reference_logps(
        model, tokenizer.pad_token_id, rows, spec.get("batch_size", 4), progress=False, state=state
    )
    return {"world_size": state.num_processes, "chosen": chosen, "rejected": rejected}


def evaluation(spec: dict[str, Any]) -> dict[str, Any]:
    """Answer metrics of ``eval_split``'s prompts and implicit rewards of the ``preference`` pairs, sharded."""
    import dataclasses

    import datasets

    from trainers.evaluation import GenerationSpec, answer_metrics, preference_rewards, score_prompts

    model, tokenizer, state = loaded_model(spec)
    splits = datasets.load_from_disk(spec["splits"])
    generation = GenerationSpec(**spec.get("generation", {}))
    prompts = splits[spec.get("eval_split", "eval_prompts")].to_list()
    results = score_prompts(model, tokenizer, prompts, generation, state)
    metrics = answer_metrics(results, [1, generation.num_samples], generation.seed)
    pairs = splits["preference"].to_list()
    metrics |= preference_rewards(model, tokenizer, pairs, spec.get("beta", 0.5), generation.batch_size, state)
    return {"world_size": state.num_processes, "metrics": metrics, "results": [dataclasses.asdict(r) for r in results]}


JOBS = {"train": train_stage, "reference": reference_pass, "evaluate": evaluation}


def run_spec(spec: dict[str, Any]) -> None:
    """Run the spec's ``job`` (default ``train``) in this process; rank 0 writes its result."""
    import_plugins(spec.get("plugins", []))
    result = JOBS[spec.get("job", "train")](spec)
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(spec["output_dir"]) / HISTORY_FILE).write_text(json.dumps(result))
    end_process_group()


def end_process_group() -> None:
    """Destroy the launch's process group once the job is done, as torch asks of a process before
    it exits. (Alone it did not stop the aborts at exit: :func:`end_without_teardown`.)"""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


EXIT_CODE = 1  # of a launched process, until its job has returned (:func:`run_as_launched_process`)


def end_without_teardown() -> None:
    """The exit hook of a launched process (:func:`run_as_launched_process`): end it without the
    interpreter's teardown. After a finished run, with its results written and its process
    group destroyed, that teardown now and then aborted the process in torch's C++ state (SIGABRT,
    "terminate called without an active exception": 1 run in about 12 of the FSDP test)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def run_as_launched_process(job: Callable[[], None]) -> None:
    """Run ``job`` as the body of this launched process, which then exits 0, or 1 when it raised
    (after the traceback), without interpreter teardown. The exit hooks registered after this call
    (torch's, transformers', those of what the job imports) run first; those registered before it do
    not run: in ``tasks.launched_stage``, from its imports, logging's shutdown, multiprocessing's
    exit function and MLflow's end of a fluent run. A rank needs none of them: it logs to stderr,
    starts no multiprocessing children and no fluent run, and closes its metrics sender when
    training ends."""
    global EXIT_CODE
    atexit.register(end_without_teardown)
    job()
    EXIT_CODE = 0


def main(argv: list[str] | None = None) -> None:
    """The entry point of a launched process (``-m trainers.launch``, or a module that adds a job)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: accelerate launch ... -m trainers.launch SPEC.json")
    run_as_launched_process(lambda: run_spec(json.loads(Path(args[0]).read_text())))


if __name__ == "__main__":
    main()
