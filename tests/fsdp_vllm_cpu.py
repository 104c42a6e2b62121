"""GRPO's colocated vLLM engine over a policy sharded with FSDP on the CPU, in every process of an
``accelerate launch --multi_gpu`` (gloo): the worker of ``tests/test_vllm.py``, in the vLLM
environment. The policy is sharded as ``tests/fsdp_cpu.py`` shards it (the spec's ``sharding``);
each process's engine is built from the gathered weights (vLLM's external launcher), samples the
process's share of the prompts, then, after one optimizer step of the sharded policy and of a whole
copy, is synced and samples again. Each process measures the largest |Δ| between the engine's
log-prob of each sampled token and the whole copy's. Rank 0 writes every process's results to
``result.json`` in the spec's ``output_dir``; ``model`` is the checkpoint.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from fsdp_cpu import SHARD, training_step

PROMPTS = 8


def largest_gap(whole: torch.nn.Module, prompts: list[list[int]], rollouts, stop: int) -> float:
    """The largest |engine log-prob − ``whole``'s log-prob| of a sampled token (up to the first stop)."""
    worst = 0.0
    for prompt, tokens, engine in zip(prompts, rollouts.tokens.tolist(), rollouts.engine_logps.tolist()):
        kept = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        with torch.no_grad():
            logits = whole(input_ids=torch.tensor([prompt + tokens[:kept]])).logits[0, len(prompt) - 1 : -1]
        mine = logits.log_softmax(-1).gather(1, torch.tensor(tokens[:kept])[:, None])[:, 0]
        worst = max(worst, (mine - torch.tensor(engine[:kept])).abs().max().item())
    return worst


def main(spec: dict) -> None:
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from trainers.grpo.trainer import GRPOConfig, GRPOTrainer
    from trainers.models.pretrained import load_causal_lm
    from trainers.runtime.launched_process import end_process_group
    from trainers.runtime.parameter_sharding import SHARDINGS

    state = PartialState(cpu=True)
    rank, world = state.process_index, state.num_processes
    policy, tokenizer = load_causal_lm(spec["model"])
    whole = copy.deepcopy(policy)
    policy = SHARD[spec["sharding"]](policy, world)
    sharded_optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    args = GRPOConfig(
        output_dir=str(Path(spec["output_dir"]) / "grpo"),
        per_device_train_batch_size=PROMPTS // world,
        num_generations=4,
        max_completion_length=6,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        generation_backend="vllm",
    )
    trainer = GRPOTrainer(model=whole, args=args, processing_class=tokenizer, reward_funcs=["format"])
    trainer.sharding = SHARDINGS[spec["sharding"]]
    share = PROMPTS // world
    prompts = [tokenizer(f"{a}+{a + 1}=")["input_ids"] for a in range(PROMPTS)][rank * share : (rank + 1) * share]
    stop = trainer.stop_ids[0]
    gaps = [largest_gap(whole, prompts, trainer.generate(policy, prompts), stop)]

    batch = torch.tensor([tokenizer("1+2=3")["input_ids"], tokenizer("4+4=8")["input_ids"]])
    policy.train()
    whole.train()
    training_step(policy, sharded_optimizer, batch)
    training_step(whole, whole_optimizer, batch)
    whole.eval()
    trainer.state.global_step = 1  # the policy took a step: the next generation syncs the engine
    gaps.append(largest_gap(whole, prompts, trainer.generate(policy, prompts), stop))

    result = {
        "rank": rank,
        "world_size": world,
        "gaps": gaps,
        "syncs": trainer.backend.engine.syncs,
        "aliases": trainer.backend.engine.aliases,
    }
    results = gather_object([result])
    if rank == 0:
        (Path(spec["output_dir"]) / "result.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    from trainers.runtime.launched_process import run_as_launched_process

    run_as_launched_process(lambda: main(json.loads(Path(sys.argv[1]).read_text())))
