"""The generation server a stage asks for (GRPO in vLLM server mode with no server's address): started
for the stage by the train task, its output in the task's logs, its address in the stage's MLflow
run (``alignflow.vllm_server``), stopped when the stage ends, fails or is cancelled
(:mod:`infra.core.generation_server`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prefect import get_run_logger

from infra.core.generation_server import managed_generation_server
from infra.core.stage_io import StageFolder
from tasks.mlflow_runs import client
from trainers.catalog import STAGES
from trainers.sections import TrainingConfig


@contextmanager
def served_section(stage: str, section: TrainingConfig, folder: StageFolder, run_id: str) -> Iterator[TrainingConfig]:
    """``section`` as its trainer gets it: with the address of the generation server the stage asks
    for (:attr:`trainers.stages.spec.StageSpec.generation_server`), started for the block on the GPUs
    it names (and, when its weights travel through a folder, with that folder in the stage's folder)."""
    server = STAGES[stage].generation_server(section)
    if server is None:
        yield section
        return
    logger = get_run_logger()
    transfer = folder.path / "vllm-transfer"
    started = time.perf_counter()

    def log(line: str) -> None:
        logger.info("%s: vLLM server: %s", stage, line)

    with managed_generation_server(transfer, log, gpus=server.gpus) as url:
        logger.info("%s: vLLM server up at %s after %.1f s", stage, url, time.perf_counter() - started)
        client().set_tag(run_id, "alignflow.vllm_server", url)
        yield server.served(url, str(transfer) if server.uses_folder else None)
    logger.info("%s: vLLM server at %s stopped", stage, url)
