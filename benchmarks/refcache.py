"""Reference stage wall time on a cache miss vs. a hit, on the default config's data.

    .venv/bin/python benchmarks/refcache.py [--repeats 5] [--batch-size 128] [--threads N]

The reference is the built-in tiny Llama with fresh weights (seed 0): the same architecture
and size as the default run's SFT model, which is the reference there, so the forward cost is
the same without training it first. Everything runs in a temporary ALIGNFLOW_HOME.

* miss: ``cache_ref_logps`` on an empty cache: load the model, one forward pass over every
  pair (train and eval), write Parquet + manifest.
* hit: ``cache_ref_logps`` again: content key, manifest and checksum verification, nothing else.
  (In a flow, a Prefect cache hit skips even that.)
* read: ``with_reference_columns``, what the DPO and evaluate tasks do: verify, then join the
  columns onto the prepared data by row id.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
HOME = tempfile.mkdtemp(prefix="alignflow-bench-refcache-")
os.environ["ALIGNFLOW_HOME"] = HOME
atexit.register(shutil.rmtree, HOME, ignore_errors=True)

from infra.core.settings import configure_environment  # noqa: E402

configure_environment()

import torch  # noqa: E402
from prefect.logging import disable_run_logger  # noqa: E402

from infra.core.config import DataConfig, ModelConfig, ReferenceConfig, load_config  # noqa: E402
from tasks.data import prepare_dataset  # noqa: E402
from tasks.models import resolve_model  # noqa: E402
from tasks.reference import cache_ref_logps, with_reference_columns  # noqa: E402


def timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repeats", type=int, default=5, help="hits and reads timed (misses: 2, each on an empty cache)"
    )
    parser.add_argument("--batch-size", type=int, default=ReferenceConfig().batch_size)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    reference = resolve_model.fn(ModelConfig(source=config.model.source))
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(**config.data.model_dump()), reference)
        pairs = data.rows["preference"] + data.rows["preference_eval"]
        reference_config = ReferenceConfig(batch_size=args.batch_size)
        misses = []
        for attempt in range(2):
            os.environ["ALIGNFLOW_REFERENCE_CACHE"] = f"{HOME}/reference-cache-{attempt}"
            seconds, ref = timed(lambda: cache_ref_logps.fn(data, reference, reference_config))
            misses.append(seconds)
        hits = [timed(lambda: cache_ref_logps.fn(data, reference, reference_config))[0] for _ in range(args.repeats)]
        reads = [timed(lambda: with_reference_columns(ref))[0] for _ in range(args.repeats)]

    miss, hit, read = statistics.median(misses), statistics.median(hits), statistics.median(reads)
    print(
        f"reference stage, {pairs} pairs ({data.rows['preference']} train "
        f"+ {data.rows['preference_eval']} eval), batch {args.batch_size}, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print("| case | median wall time | runs |\n|---|---|---|")
    print(
        f"| miss (compute + write) | {miss:.3f} s ({pairs / miss:.0f} "
        f"pairs/s) | {', '.join(f'{s:.3f}' for s in misses)} |"
    )
    print(
        f"| hit (key + verify) | {hit * 1000:.1f} ms = {100 * hit / miss:.2f}% "
        f"of miss | {', '.join(f'{s * 1000:.1f}' for s in hits)} ms |"
    )
    print(
        f"| read + join (DPO/evaluate side) | {read * 1000:.1f} ms | {', '.join(f'{s * 1000:.1f}' for s in reads)} ms |"
    )


if __name__ == "__main__":
    main()
