"""Peak memory of preparing a dataset with one huge row: texts clipped in characters before
tokenizing (``trainers/data/clipping.py``, the pipeline's way) vs. tokenized whole.

The file is a ``.jsonl`` SFT split of 60 addition rows and one whose prompt is ``--megabytes`` MB
(``"1+2+1+2+…"``); the built-in tiny model's tokenizer (one token per character) prepares it
through the pipeline's ``prepare_dataset`` task, each mode in a fresh process. Figures per
process: RSS after the imports and the model (``VmRSS``), peak RSS (``VmHWM``), their difference
(what preparing took), and the seconds preparing took.

    .venv/bin/python benchmarks/big_row_memory.py                   # 50 MB, both modes, a markdown table
    .venv/bin/python benchmarks/big_row_memory.py --megabytes 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("clipped", "whole")


def status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def write_split(path: Path, megabytes: float) -> None:
    rng = random.Random(0)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(60)]
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs]
    rows.append({"prompt": "1+2+" * int(megabytes * 1e6 / 4) + "3=", "completion": "6"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def child(mode: str, path: Path) -> dict:
    """Prepare ``path`` in this process; ``whole``: with a clip that never clips."""
    from prefect.logging import disable_run_logger

    from infra.core.config import DataConfig, DatasetSource, ModelConfig
    from tasks.data import prepare_dataset
    from tasks.models import resolve_model
    from trainers.data import clipping

    if mode == "whole":
        clipping.TextClip.for_tokenizer = classmethod(lambda cls, tokenizer, most, keep_end: cls(sys.maxsize, keep_end))
    with disable_run_logger():
        policy = resolve_model.fn(ModelConfig())
        before, started = status_kib("VmRSS"), time.perf_counter()
        data = prepare_dataset.fn(DataConfig(builtin=None, sft=DatasetSource(path=str(path))), policy)
    seconds = time.perf_counter() - started
    return {
        "mode": mode,
        "before_mib": before / 1024,
        "peak_mib": status_kib("VmHWM") / 1024,
        "seconds": seconds,
        "rows": data.rows,
    }


def measure(mode: str, megabytes: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="alignflow-big-row-") as folder:
        path = Path(folder) / "sft.jsonl"
        write_split(path, megabytes)
        env = os.environ | {"ALIGNFLOW_HOME": str(Path(folder) / "home"), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        command = [sys.executable, __file__, "--child", mode, str(path)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"megabytes": megabytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=50.0, help="size of the one huge prompt (50)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", action="store_true", help="one JSON object per mode instead of the table")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child[0], Path(options.child[1]))))
        return
    results = [measure(mode, options.megabytes) for mode in options.modes]
    if options.json:
        print("\n".join(json.dumps(result) for result in results))
        return
    print(f"one {options.megabytes:g} MB prompt among 60 rows, the built-in tokenizer; load {os.getloadavg()[0]:.2f}\n")
    print("| mode | RSS before (MiB) | peak RSS (MiB) | preparing took (MiB) | seconds |")
    print("|---|---|---|---|---|")
    for r in results:
        took = r["peak_mib"] - r["before_mib"]
        print(f"| {r['mode']} | {r['before_mib']:.0f} | {r['peak_mib']:.0f} | {took:.0f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
