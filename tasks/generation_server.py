"""The vLLM server a GRPO stage in server mode generates with when its config names none: started
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
from trainers.grpo_section import FOLDER_TRANSFERS, GRPOStageConfig
from trainers.sections import TrainingConfig


@contextmanager
def served_section(stage: str, section: TrainingConfig, folder: StageFolder, run_id: str) -> Iterator[TrainingConfig]:
    """``section`` as its trainer gets it: where it starts its vLLM server, with the address of one
    started for the block (and, for the storage transfer, its folder in the stage's folder)."""
    if not (isinstance(section, GRPOStageConfig) and section.starts_generation_server):
        yield section
        return
    logger = get_run_logger()
    transfer = folder.path / "vllm-transfer"
    started = time.perf_counter()

    def log(line: str) -> None:
        logger.info("%s: vLLM server: %s", stage, line)

    with managed_generation_server(transfer, log, gpus=section.vllm_server_gpus) as url:
        logger.info("%s: vLLM server up at %s after %.1f s", stage, url, time.perf_counter() - started)
        client().set_tag(run_id, "alignflow.vllm_server", url)
        update = {"vllm_server_url": url}
        if section.vllm_weight_transfer in FOLDER_TRANSFERS:  # the stage's folder
            update["vllm_transfer_folder"] = str(transfer)
        yield section.model_copy(update=update)
    logger.info("%s: vLLM server at %s stopped", stage, url)
