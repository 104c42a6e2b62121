"""The launched side of ``helpers.launch_worker``: every rank's results gathered to rank 0, which
writes them to ``result.json`` in the spec's ``output_dir``, and a worker module's entry."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable


def write_results(spec: dict, result: dict) -> None:
    """Gather each rank's ``result``; rank 0 writes them, in rank order; then the group ends."""
    from accelerate.utils import gather_object

    from trainers.runtime.launched_process import end_process_group

    results = gather_object([result])
    if result["rank"] == 0:
        (Path(spec["output_dir"]) / "result.json").write_text(json.dumps(results))
    end_process_group()


def run_worker(main: Callable[[dict], None]) -> None:
    """A worker module's ``__main__``: ``main`` of the spec file named on the command line, as a launched process."""
    from trainers.runtime.launched_process import run_as_launched_process

    run_as_launched_process(lambda: main(json.loads(Path(sys.argv[1]).read_text())))
