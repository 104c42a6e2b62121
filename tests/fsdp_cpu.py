"""FSDP on the CPU, in every process of an ``accelerate launch --multi_gpu`` (gloo): the worker of
``tests/test_sharded_params.py``.

accelerate 1.15 never selects FSDP on the CPU (``use_cpu`` gives MULTI_CPU, i.e. DDP), so the
policy is sharded here with torch itself, each decoder layer and the root as infra/core/accelerate's
TRANSFORMER_BASED_WRAP does (each of the spec's ``shardings`` in turn, on a new copy of the model, in
one process group: ``fsdp2``, ``fully_shard``; ``fsdp1``, ``FullyShardedDataParallel``), and that
entry of trainers/runtime/parameter_sharding.py is used by name. Each process checks against a whole copy of
the same model: GRPO's seeded generation (``GRPOTrainer.generate``), a greedy generation of a
different length on each process (lockstep), the TR-DPO sync after a training step, and a second
training step after the sync. Rank 0 writes the results of all processes to ``result.json`` in
the spec's ``output_dir`` (per process, by sharding); ``model`` is the checkpoint. One process runs
it over a process group of one.

    PYTHONPATH=.:tests python -m accelerate.commands.launch --multi_gpu --num_processes 2 -m fsdp_cpu SPEC.json
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from worker_results import run_worker, write_results


def largest_difference(first: torch.nn.Module, second: torch.nn.Module) -> float:
    pairs = zip(first.state_dict().values(), second.state_dict().values())
    return max((a - b).abs().max().item() for a, b in pairs)


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def fsdp2(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp1(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer_type = type(model.model.layers[0])
    wrap = ModuleWrapPolicy({layer_type})
    return FullyShardedDataParallel(model, auto_wrap_policy=wrap, device_id=torch.device("cpu"), use_orig_params=True)


SHARD = {"fsdp2": fsdp2, "fsdp1": fsdp1}


def local_size(model: torch.nn.Module) -> int:
    """Parameter elements this process holds (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def main(spec: dict) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    if not torch.distributed.is_initialized():  # one process: FSDP still needs a process group
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    rank, world = state.process_index, state.num_processes
    out = Path(spec["output_dir"])
    result = {"rank": rank, "world_size": world}
    for name in spec["shardings"]:
        result[name] = check_sharding(name, spec["model"], rank, world, out / name)
    write_results(spec, result)


def check_sharding(name: str, model: str, rank: int, world: int, out: Path) -> dict:
    """This process's results for the sharding ``name`` of a new copy of ``model``."""
    from transformers import TrainerState

    from trainers.grpo.trainer import GRPOConfig, GRPOTrainer
    from trainers.models.pretrained import load_causal_lm
    from trainers.runtime.callbacks import SyncReferenceCallback, mix_into_reference
    from trainers.runtime.parameter_sharding import SHARDINGS, forward_model

    policy, tokenizer = load_causal_lm(model)
    initial = copy.deepcopy(policy)
    whole = copy.deepcopy(policy)
    whole_size = local_size(whole)
    policy = SHARD[name](policy, world)
    # Before any forward, as accelerate.prepare does: after a forward outside training a unit may
    # stay unsharded, and its parameters() are then the unsharded tensors, not the ones to optimize.
    sharded_optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    sharding = SHARDINGS[name]
    result = {"whole_size": whole_size, "sharded_size": local_size(policy)}

    # GRPO's seeded generation: this process's share of a generation batch of 8 rows.
    args = GRPOConfig(
        output_dir=str(out / "grpo"),
        per_device_train_batch_size=8 // world,
        num_generations=4,
        max_completion_length=6,
        generation_seed=7,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=whole, args=args, processing_class=tokenizer, reward_funcs=["format"])
    prompts = [tokenizer(f"{a}+{a + 1}=")["input_ids"] for a in range(8)][rank * (8 // world) :][: 8 // world]
    trainer.sharding = sharding
    sharded_rows = trainer.generate(policy, prompts).tokens.tolist()
    trainer.sharding, trainer.generation_calls = SHARDINGS["replicated"], 0
    result["grpo_completions"] = sharded_rows
    result["grpo_matches_whole"] = sharded_rows == trainer.generate(whole, prompts).tokens.tolist()

    # Greedy generation of a different length on each process: only lockstep keeps the gathers paired.
    ids = torch.tensor([tokenizer("3+4=")["input_ids"]])
    length = 3 + 3 * rank
    with forward_model(policy, trainer.accelerator, sharding) as unwrapped:
        lockstep = unwrapped.generate(
            input_ids=ids, max_new_tokens=length, min_new_tokens=length, do_sample=False, synced_gpus=True
        )
    alone = whole.generate(input_ids=ids, max_new_tokens=length, min_new_tokens=length, do_sample=False)
    result["lockstep_length"] = lockstep.shape[1] - ids.shape[1]
    result["lockstep_matches_whole"] = torch.equal(lockstep, alone)

    # One training step of both (the same batch on every process), then the TR-DPO sync.
    batch = torch.tensor([tokenizer("1+2=3")["input_ids"], tokenizer("4+4=8")["input_ids"]])
    policy.train()
    whole.train()
    result["step1_loss_difference"] = abs(
        training_step(policy, sharded_optimizer, batch) - training_step(whole, whole_optimizer, batch)
    )
    synced, expected = copy.deepcopy(initial), copy.deepcopy(initial)
    SyncReferenceCallback(synced, alpha=0.5, sync_steps=1, sharding=sharding).on_step_end(
        None, TrainerState(global_step=1), None, model=policy
    )
    mix_into_reference(expected, whole, 0.5)
    result["sync_difference"] = largest_difference(synced, expected)
    result["sync_moved"] = largest_difference(synced, initial)
    result["size_after_sync"] = local_size(policy)
    result["step2_loss_difference"] = abs(
        training_step(policy, sharded_optimizer, batch) - training_step(whole, whole_optimizer, batch)
    )

    return result


if __name__ == "__main__":
    run_worker(main)
