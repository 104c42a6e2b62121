"""One weight sync of GRPO's vLLM engine by each way it can travel (issue 28): colocated (an in-place
reload in the trainer's process), and to a managed vLLM server by ``storage`` (a safetensors file and
a reload call) and by ``collective`` (a broadcast over a process group of the trainer and the server;
gloo here, NCCL between GPUs). The 20M shape (``builtin:llama-20m``: vocabulary 16,384, hidden 384,
8 layers, tied), in float32; the transfers interleaved round by round, the median and the fastest round reported.

    .venv-vllm/bin/python benchmarks/weight_transfer.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from infra.core.generation_server import managed_generation_server
from trainers.generation.vllm_engine import ColocatedEngine, EngineOptions, SyncedEngine, serving_weights
from trainers.generation.vllm_server import ServerEngine
from trainers.models.builtin import build_builtin_model

OPTIONS = EngineOptions(gpu_memory_utilization=0.3, max_model_len=128, enable_sleep_mode=False, cpu_kv_cache_gib=1)


def timed_sync(engine: SyncedEngine, model: torch.nn.Module, step: int) -> float:
    with torch.no_grad():
        for param in model.parameters():  # a training step's worth of change
            param.add_(torch.randn_like(param) * 1e-3)
    started = time.perf_counter()
    engine.sync(dict(model.named_parameters()), step)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    model, _ = build_builtin_model("builtin:llama-20m", seed=0)
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {megabytes:.0f} MiB float32")
    seconds: dict[str, list[float]] = {"colocated": [], "storage": [], "collective": []}
    with tempfile.TemporaryDirectory(prefix="alignflow-transfer-") as root:
        with managed_generation_server(Path(root), lambda line: None) as url:
            engines: dict[str, SyncedEngine] = {
                transfer: ServerEngine(model, serving_weights(model), OPTIONS, 0, 0, url, transfer, Path(root))
                for transfer in ("storage", "collective")  # one server engine: the second load replaces the first
            }
            engines["colocated"] = ColocatedEngine(model, serving_weights(model), OPTIONS, 0, 0)
            try:
                for step in range(1, options.rounds + 1):
                    order = list(seconds) if step % 2 else list(reversed(seconds))
                    for name in order:
                        seconds[name].append(timed_sync(engines[name], model, step))
            finally:
                engines["colocated"].close()
    print(f"{'sync':<12}{'median s':>10}{'fastest s':>11}{'MiB/s (median)':>16}")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:<12}{median:>10.3f}{min(values):>11.3f}{megabytes / median:>16.0f}")
    print("the first collective round opens the channel:", f"{seconds['collective'][0]:.3f} s")


if __name__ == "__main__":
    main()
