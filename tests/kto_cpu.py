"""KTO's loss in every process of an ``accelerate launch --multi_gpu`` (gloo): the worker of
``tests/test_kto.py``. Each process takes its contiguous share of the spec's ``rows`` (unpaired
rows with their KL completions and cached reference log-probs) as one batch and scores it with
``KTOTrainer.compute_loss`` (``reference='cached'``, eval mode); rank 0 writes every process's loss
and logged ``kl`` (z₀) to ``result.json`` in the spec's ``output_dir``. One process takes all rows.

    PYTHONPATH=.:tests python -m accelerate.commands.launch --multi_gpu --num_processes 2 -m kto_cpu SPEC.json
"""

from __future__ import annotations

from pathlib import Path

import torch
from worker_results import run_worker, write_results


def main(spec: dict) -> None:
    from accelerate import PartialState

    from trainers.kto.trainer import KTOConfig, KTOTrainer, UnpairedCollator
    from trainers.models.pretrained import load_causal_lm

    state = PartialState(cpu=True)
    rank, world = state.process_index, state.num_processes
    model, tokenizer = load_causal_lm(spec["model"])
    args = KTOConfig(
        output_dir=str(Path(spec["output_dir"]) / "trainer"),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        reference="cached",
        **spec["kto"],
    )
    trainer = KTOTrainer(model=model.eval(), args=args)
    share = len(spec["rows"]) // world
    batch = UnpairedCollator(tokenizer.pad_token_id)(spec["rows"][rank * share : (rank + 1) * share])
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    result = {"rank": rank, "world_size": world, "loss": loss.item(), "kl": trainer.window_metrics["eval"]["kl"]}
    write_results(spec, result)


if __name__ == "__main__":
    run_worker(main)
