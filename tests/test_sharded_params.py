"""Sharded parameters (trainers/runtime/parameter_sharding.py): the gather each accelerate distributed type
gets, the reference preparation, and FSDP2 under real processes on the CPU (gloo).

accelerate 1.15 selects neither FSDP nor DeepSpeed on the CPU, so the FSDP2 test shards the policy
with torch itself (``fully_shard``, ``FullyShardedDataParallel``: tests/fsdp_cpu.py) and uses the
``fsdp2`` / ``fsdp1`` entry by name.
What only a GPU runs (accelerate's own FSDP and DeepSpeed preparation, ZeRO-3) is in
``benchmarks/gpu_check.py --sharding``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType
from helpers import launch_worker

from trainers.runtime.parameter_sharding import SHARDINGS, sharding_of

REPO = Path(__file__).resolve().parents[1]


def accelerate_state(distributed_type: DistributedType, fsdp_version: int = 2, zero_stage: int = 3):
    """The parts of an ``AcceleratorState`` that say how a prepared model's parameters are laid out."""
    return SimpleNamespace(
        distributed_type=distributed_type,
        fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version),
        deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage),
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "state, expected, lockstep",
    [
        (accelerate_state(DistributedType.NO), "replicated", False),
        (accelerate_state(DistributedType.MULTI_CPU), "replicated", False),
        (accelerate_state(DistributedType.MULTI_GPU), "replicated", False),
        (accelerate_state(DistributedType.DEEPSPEED, zero_stage=2), "replicated", False),
        (accelerate_state(DistributedType.DEEPSPEED, zero_stage=3), "zero3", True),
        (accelerate_state(DistributedType.FSDP, fsdp_version=1), "fsdp1", True),
        (accelerate_state(DistributedType.FSDP, fsdp_version=2), "fsdp2", True),
    ],
)
def test_each_distributed_type_gets_its_parameter_gather(state, expected, lockstep):
    sharding = sharding_of(state)
    assert sharding is SHARDINGS[expected]
    assert sharding.lockstep is lockstep


@pytest.mark.unit
def test_the_replicated_gathers_are_no_ops_and_the_reference_is_prepared_whole_and_frozen(tiny):
    import copy

    from accelerate import Accelerator

    from trainers.runtime.parameter_sharding import forward_model, prepare_reference

    model = copy.deepcopy(tiny[0])
    accelerator = Accelerator()  # as the in-process trainers make it (one shared accelerate state)
    replicated = sharding_of(accelerator.state)
    assert replicated.name == "replicated"
    with replicated.full_parameters(model), forward_model(model, accelerator, replicated) as unwrapped:
        assert unwrapped is model
    reference = prepare_reference(model, accelerator)
    assert reference is model and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    assert {p.device for p in reference.parameters()} == {accelerator.device}


@pytest.mark.unit
def test_a_model_samples_in_eval_mode_and_trains_again_after_even_when_sampling_fails():
    import torch
    from accelerate import Accelerator

    from trainers.runtime.parameter_sharding import sampling_model

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    accelerator = Accelerator()
    replicated = sharding_of(accelerator.state)
    with sampling_model(model, accelerator, replicated) as sampler:
        assert sampler is model and [m.training for m in model.modules()] == [False] * 3
    assert [m.training for m in model.modules()] == [True] * 3
    with pytest.raises(RuntimeError, match="generation failed"), sampling_model(model, accelerator, replicated):
        raise RuntimeError("generation failed")
    assert model.training
    model.eval()  # a model that was not training stays so
    with sampling_model(model, accelerator, replicated):
        pass
    assert not model.training


SHARDED = ["fsdp2", "fsdp1"]


@pytest.fixture(scope="module")
def fsdp_ranks(tiny_checkpoint, tmp_path_factory) -> dict[int, list[dict]]:
    """tests/fsdp_cpu.py over 2 CPU processes and over 1, each launch checking every FSDP version in
    turn (one launch per process count, not per version: a launch's ranks spend ~8 CPU s importing);
    every rank's results, by process count."""
    folder = tmp_path_factory.mktemp("fsdp")
    spec = {"model": tiny_checkpoint.path, "shardings": SHARDED}
    return {processes: launch_worker("fsdp_cpu", spec, processes, folder / str(processes)) for processes in (2, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDED)
def test_fsdp_on_two_processes_generates_syncs_and_trains_as_one_unsharded_process(sharding, fsdp_ranks):
    two = [rank[sharding] for rank in fsdp_ranks[2]]
    one = [rank[sharding] for rank in fsdp_ranks[1]]
    for rank in two:  # each process holds about half of the parameters, before and after the sync
        assert rank["sharded_size"] == rank["size_after_sync"] < 0.6 * rank["whole_size"]
    for rank in two + one:
        # GRPO's seeded generation by the sharded policy equals that of a whole copy
        assert rank["grpo_matches_whole"] and rank["lockstep_matches_whole"]
        assert rank["step1_loss_difference"] <= 1e-5 and rank["step2_loss_difference"] <= 1e-5
        # the synced reference is the one mixed from the unsharded policy, and it moved
        assert rank["sync_difference"] <= 1e-6 < rank["sync_moved"]
    # 2 processes × 4 completions are 1 process's 8, row for row
    assert two[0]["grpo_completions"] + two[1]["grpo_completions"] == one[0]["grpo_completions"]
    assert len(one[0]["grpo_completions"]) == 8
    # each process generated its own length; without lockstep the unequal gathers hang
    assert [rank["lockstep_length"] for rank in two] == [3, 6]


@pytest.mark.unit
def test_a_reference_without_its_weights_on_this_process_is_refused(tiny):
    import copy

    from accelerate import Accelerator

    from trainers.runtime.parameter_sharding import prepare_reference

    empty = copy.deepcopy(tiny[0]).to("meta")  # as FSDP's cpu_ram_efficient_loading leaves ranks other than 0
    with pytest.raises(ValueError, match="the reference's parameter model.embed_tokens.weight holds no weights"):
        prepare_reference(empty, Accelerator())


@pytest.mark.slow
def test_the_gpu_checks_sharding_section_refuses_fsdp_on_the_cpu_and_its_ddp_smoke_passes(tmp_path):
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: run benchmarks/gpu_check.py --sharding itself")
    script = [sys.executable, "benchmarks/gpu_check.py", "--allow-cpu", "--model", "builtin:tiny-llama"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    refused = subprocess.run(script + ["--sharding", "fsdp"], cwd=REPO, capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "accelerate runs FSDP and DeepSpeed on GPUs only" in refused.stderr
    smoke = ["--sharding", "ddp", "--processes", "2", "--steps", "2"]
    done = subprocess.run(script + smoke, cwd=REPO, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded_check grpo (replicated, 2 processes)" in done.stdout
    assert "sharded_check dpo (replicated, 2 processes)" in done.stdout
    assert "generation, the live reference and the TR-DPO sync are correct under ddp" in done.stdout
    phases = [line.split(" (")[0] for line in done.stdout.splitlines() if line.startswith("sharded_check: ")]
    assert phases == [  # the main process's progress, once each: a timeout shows which phase it cut
        "sharded_check: GRPO trained",
        "sharded_check: generated; gathering the full weights",
        "sharded_check: DPO trained",
        "sharded_check: full weights gathered; one more sync",
    ]
