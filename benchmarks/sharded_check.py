"""GPU check of sharded parameters (``benchmarks/gpu_check.py --sharding fsdp|zero3``), in every
process of an ``accelerate launch`` with infra/core/accelerate's FSDP or ZeRO-3 config, in bf16.

What the CPU tests cannot run (accelerate selects neither FSDP nor DeepSpeed on the CPU): the
stages' own trainers prepared by accelerate under the sharding. Per process it checks that

* the policy's parameters are laid out as expected (``fsdp2`` / ``zero3``) and the reference is whole;
* GRPO (β > 0, seeded generation) trains, and a greedy generation of a different length on each
  process completes (lockstep) with tokens the shape asked for;
* a forward of the unwrapped policy (generation's path) matches a whole copy of its weights
  (accelerate's own full state dict, broadcast from rank 0);
* DPO with the live reference and the TR-DPO sync trains, the sync moved the reference, and one
  more sync gives ``α·θ + (1 − α)·ref`` of those full weights.

Spec (JSON): ``stage`` (``grpo`` or ``dpo``: one per launch, so that no model is loaded after a
trainer's arguments exist), ``model``, ``output_dir``, ``sharding`` (the expected entry),
``world_size``, ``steps``, ``cpu`` (a smoke of the logic: plain DDP on the CPU, in fp32).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

ALPHA = 0.5
STARTED = time.perf_counter()


def progress(message: str) -> None:
    """A line from the main process with the seconds since the process started: a timeout shows
    which phase it cut."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"sharded_check: {message} ({time.perf_counter() - STARTED:.0f} s)", flush=True)


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """The policy's full state dict by accelerate's own gather (rank 0), on every process, in fp32."""
    from accelerate.utils import broadcast_object_list

    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    box = [
        {name: tensor.float().cpu() for name, tensor in state.items()} if trainer.accelerator.is_main_process else None
    ]
    broadcast_object_list(box)
    return box[0]


def whole_copy(reference: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The (whole) reference's architecture with ``weights``: no loading, which under ZeRO-3 would
    partition it once the trainer's arguments exist."""
    model = copy.deepcopy(reference)
    model.load_state_dict(weights, strict=False)  # a tied head is absent from the state dict
    return model.eval()


def is_whole(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


def check_grpo(spec: dict, inputs, rows: list[dict]) -> dict:
    from trainers.catalog import STAGES
    from trainers.grpo.section import GRPOStageConfig
    from trainers.runtime.parameter_sharding import forward_model

    section = GRPOStageConfig(
        per_device_train_batch_size=8,
        num_generations=8,
        max_steps=spec["steps"],
        logging_steps=1,
        save_steps=0,
        beta=0.04,
        generation_seed=7,
        max_completion_length=8,
        log_completions_steps=0,
    )
    trainer = STAGES["grpo"].build(section, inputs)
    trainer.train()
    progress("GRPO trained")
    accelerator, sharding = trainer.accelerator, trainer.sharding
    assert sharding.name == spec["sharding"], sharding.name
    assert is_whole(trainer.ref_model), "the GRPO reference was sharded"
    ids = torch.tensor([rows[accelerator.process_index]["prompt_ids"]], device=accelerator.device)
    length = 4 + 4 * accelerator.process_index
    with torch.no_grad(), forward_model(trainer.model_wrapped, accelerator, sharding) as policy:
        policy.eval()
        generated = policy.generate(
            input_ids=ids, max_new_tokens=length, min_new_tokens=length, do_sample=False, synced_gpus=sharding.lockstep
        )
        logits = policy(input_ids=generated).logits.float()
    assert generated.shape[1] == ids.shape[1] + length, generated.shape
    progress("generated; gathering the full weights")
    whole = whole_copy(trainer.ref_model, full_weights(trainer))
    precision = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    with torch.no_grad(), torch.autocast(accelerator.device.type, dtype=precision, enabled=precision != torch.float32):
        expected = whole(input_ids=generated).logits.float()
    difference = (logits - expected).abs().max().item()
    assert difference <= 0.1 * expected.abs().max().item(), (
        f"sharded forward differs from the whole weights by {difference}"
    )
    return {"grpo_loss": trainer.state.log_history[-2].get("loss"), "logit_difference": difference}


def check_dpo(spec: dict, inputs) -> dict:
    from trainers.catalog import STAGES
    from trainers.dpo.section import DPOStageConfig
    from trainers.runtime.callbacks import mix_into_reference
    from trainers.runtime.parameter_sharding import sharding_of

    section = DPOStageConfig(
        per_device_train_batch_size=4,
        max_steps=spec["steps"],
        logging_steps=1,
        save_steps=0,
        eval_strategy="no",
        reference="live",
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=ALPHA,
    )
    trainer = STAGES["dpo"].build(section, inputs)
    initial = copy.deepcopy(trainer.ref_model.state_dict())
    trainer.train()
    progress("DPO trained")
    sharding = sharding_of(trainer.accelerator.state)
    assert sharding.name == spec["sharding"], sharding.name
    reference = trainer.ref_model
    assert is_whole(reference), "the DPO reference was sharded"
    moved = max((reference.state_dict()[n].float() - t.float()).abs().max().item() for n, t in initial.items())
    assert moved > 0, "the TR-DPO sync did not move the reference"
    before = {n: t.detach().float().cpu().clone() for n, t in reference.state_dict().items()}
    full = full_weights(trainer)
    progress("full weights gathered; one more sync")
    mix_into_reference(reference, trainer.model_wrapped, ALPHA, sharding)
    after = reference.state_dict()
    worst = max((after[n].float().cpu() - (ALPHA * full[n] + (1 - ALPHA) * before[n])).abs().max().item() for n in full)
    assert worst <= 1e-3, f"the sync differs from α·θ + (1 − α)·ref by {worst}"
    return {"dpo_loss": trainer.state.log_history[-2].get("loss"), "sync_moved": moved, "sync_difference": worst}


def main(spec: dict) -> None:
    import datasets
    from accelerate import PartialState

    from trainers.catalog import ModelSource, StageInputs
    from trainers.data.rows import Truncation, tokenize_split
    from trainers.data.synthetic import AdditionTask, generate_addition
    from trainers.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(spec["model"])
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=20))
    pairs, _ = tokenize_split(rows["preference"][:64], "preference", tokenizer, Truncation(32, 16))
    prompts, _ = tokenize_split(rows["grpo_prompts"][:64], "grpo_prompts", tokenizer, Truncation(32, 16))
    splits = datasets.DatasetDict(
        {"preference": datasets.Dataset.from_list(pairs), "grpo_prompts": datasets.Dataset.from_list(prompts)}
    )
    source = ModelSource(spec["model"])

    def inputs(stage: str) -> StageInputs:
        folder = str(Path(spec["output_dir"]) / stage)
        precision = "no" if spec["cpu"] else "bf16"
        return StageInputs(
            source,
            source,
            splits,
            folder,
            dtype="float32",
            mixed_precision=precision,
            cpu=spec["cpu"],
            padding_free="auto",
        )

    state = PartialState(cpu=spec["cpu"])
    if state.num_processes != spec["world_size"]:
        raise SystemExit(f"sharded_check: the launch has {state.num_processes} processes, not {spec['world_size']}")
    stage = spec["stage"]
    result = check_grpo(spec, inputs(stage), prompts) if stage == "grpo" else check_dpo(spec, inputs(stage))
    if state.is_main_process:
        (Path(spec["output_dir"]) / f"{stage}.json").write_text(json.dumps(result))
        print(f"sharded_check {stage} ({spec['sharding']}, {state.num_processes} processes): {result}", flush=True)


if __name__ == "__main__":
    from trainers.runtime.launched_process import run_as_launched_process

    # without it the interpreter's teardown now and then aborted a rank after its check had passed
    # (SIGABRT, "terminate called without an active exception"; trainers.runtime.fast_exit)
    run_as_launched_process(lambda: main(json.loads(Path(sys.argv[1]).read_text())))
