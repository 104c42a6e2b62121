"""The module every process of a launched job runs (:mod:`infra.core.stage_io`, :mod:`tasks.launch`):

    python -m accelerate.commands.launch --multi_gpu ... -m tasks.launched_rank <launch folder>/spec.json

It reads the typed spec (which imports its plugins), checks the world size, runs the job and, on rank 0,
writes the job's result beside the spec; a failed rank writes its error report there
(:func:`trainers.runtime.launched_process.run_as_launched_process`). A training stage builds the same trainer as the
in-process path (:func:`tasks.stage_trainer.tracked_trainer`): rank 0 with the MLflow tracker of the
stage's run, the others with nothing that logs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel

from infra.core.config import ComputeConfig
from infra.core.launching import stop_with_parent
from infra.core.stage_io import LAUNCHED_AT, EvaluatedModel, EvaluateJob, LaunchSpec, ReferenceJob, TrainJob, read_spec
from trainers.runtime.launched_process import check_world_size, rank, run_as_launched_process

IMPORTED = time.time()  # the rank's interpreter start and this module's imports are behind it


def report_start(ready: str) -> None:
    """On each machine's first rank, one line of where the launch's fixed cost went: from the launch
    to this rank running (launcher, interpreter, imports) and from there to ``ready``."""
    launched_at = os.environ.get(LAUNCHED_AT)
    if launched_at is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"rank {rank()}: running {IMPORTED - float(launched_at):.1f} s after the launch started (launcher, "
            f"interpreter, imports); {ready} {time.time() - IMPORTED:.1f} s later",
            flush=True,
        )


def train(spec: TrainJob) -> BaseModel:
    """Train the spec's stage from its checkpoint (or its start) and save the model into ``model_dir``."""
    from tasks.stage_trainer import log_model_params, tracked_trainer, train_from
    from trainers.models.lora import save_stage_model

    run_id = spec.run_id if rank() == 0 else None
    final = spec.checkpoint if spec.final else None
    trainer = tracked_trainer(
        spec.stage, spec.section, spec.inputs, spec.folder.path, run_id, spec.log_checkpoints, policy_from=final
    )
    report_start("trainer built (spec, model, data, process group)")
    if run_id is not None:
        log_model_params(run_id, trainer, spec.inputs)
    train_from(trainer, spec.checkpoint, final)
    save_stage_model(trainer, spec.model_dir, spec.folder.adapter_dir)
    return spec.result(world_size=trainer.accelerator.num_processes, log_history=trainer.state.log_history)


def launch_state(compute: ComputeConfig):
    """This process's place in the launch (accelerate's ``PartialState``; on the CPU with ``compute.cpu``)."""
    from accelerate import PartialState

    return PartialState(cpu=compute.cpu)


def reference(spec: ReferenceJob) -> BaseModel:
    import datasets

    from trainers.catalog import REFERENCE_VIEWS
    from trainers.models.pretrained import load_causal_lm
    from trainers.scoring.reference_pass import score_view

    state = launch_state(spec.compute)
    model, tokenizer = load_causal_lm(spec.model, spec.revision, spec.compute.dtype, state.device)
    report_start("model loaded (spec, process group, model)")
    prepared = datasets.load_from_disk(str(spec.splits))
    view = REFERENCE_VIEWS.lookup(spec.view)
    columns = score_view(
        model,
        tokenizer.pad_token_id,
        view,
        prepared,
        spec.batch_size,
        progress=False,
        state=state,
        padding_free=spec.compute.padding_free,
    )
    return spec.result(world_size=state.num_processes, columns=columns)


def evaluate(spec: EvaluateJob) -> BaseModel:
    """Each model of the spec in turn (``trainers.evaluation.evaluate.evaluate_models``). On vLLM the launch
    builds one engine, each next model of the first one's shape is synced into it, and the launch
    ends at the first model of another shape: its result holds the models scored until then, and
    the parent launches the rest (``tasks.evaluate.launched_scores``)."""
    import datasets

    from trainers.evaluation.evaluate import RewardModelSource, evaluate_models, evaluation_engine
    from trainers.generation.vllm_engine import EngineShapeChanged
    from trainers.models.pretrained import load_causal_lm

    state = launch_state(spec.compute)
    splits = datasets.load_from_disk(str(spec.splits))
    prompts, pairs = (splits[name].to_list() if name in splits else [] for name in (spec.PROMPTS, spec.PAIRS))

    def load(scored: EvaluatedModel):
        model, tokenizer = load_causal_lm(
            scored.model, scored.revision, spec.compute.dtype, state.device, spec.chat_template
        )
        if scored is spec.models[0]:
            report_start("model loaded (spec, process group, model)")
        return model, tokenizer, pairs if scored.pairs else None

    rm = spec.reward_model
    source = (
        None if rm is None else RewardModelSource(rm.path, rm.revision, spec.compute.dtype, spec.compute.padding_free)
    )
    suite_folder = spec.launch_dir / f"suites-{state.process_index}"  # each process writes its own
    suite_folder.mkdir(parents=True, exist_ok=True)
    suites = spec.evaluation.resolved_suites(spec.builtin, suite_folder)
    vllm = spec.evaluation.generation_backend == "vllm"
    engines = evaluation_engine(spec.evaluation.seed, replaceable=False) if vllm else None
    scores = []
    try:
        for scored in evaluate_models(
            spec.models,
            load,
            prompts,
            spec.evaluation.spec(spec.compute.padding_free, suites),
            spec.beta,
            state,
            source,
            engines,
        ):
            scores.append(scored)
    except EngineShapeChanged:
        pass  # the next models are another launch's
    return spec.result(world_size=state.num_processes, scores=scores)


RUNNERS: dict[type, Callable] = {TrainJob: train, ReferenceJob: reference, EvaluateJob: evaluate}


def run(spec: LaunchSpec) -> None:
    check_world_size(spec.world_size)
    result = RUNNERS[type(spec)](spec)
    if rank() == 0:
        spec.result_file.write_text(result.model_dump_json())


def main(argv: list[str] | None = None) -> None:
    stop_with_parent()  # the launcher starts each rank in a session of its own: a SIGKILLed launcher leaves none
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: accelerate launch ... -m tasks.launched_rank SPEC.json")
    path = Path(args[0])
    run_as_launched_process(lambda: run(read_spec(path)), error_folder=path.parent)


if __name__ == "__main__":
    main()
