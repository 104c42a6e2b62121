"""GRPO's batch arithmetic: how one generation batch of completions becomes training steps.

Plain arithmetic, no torch: the config checks it when it loads and the trainer when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationLayout:
    """How prompts become optimizer steps.

    ``steps_per_generation`` training steps (micro-batches of ``per_device_batch_size`` rows)
    share one generation batch of ``generation_batch_size`` completions over all processes:
    ``generation_batch_size / num_generations`` distinct prompts, ``num_generations`` each.
    """

    per_device_batch_size: int
    num_processes: int
    steps_per_generation: int
    num_generations: int

    @property
    def generation_batch_size(self) -> int:
        return self.per_device_batch_size * self.num_processes * self.steps_per_generation

    @property
    def per_device_generation_batch_size(self) -> int:
        return self.per_device_batch_size * self.steps_per_generation

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations


def resolve_layout(
    *,
    per_device_batch_size: int,
    gradient_accumulation_steps: int,
    num_generations: int,
    num_processes: int = 1,
    steps_per_generation: int | None = None,
    generation_batch_size: int | None = None,
) -> GenerationLayout:
    """Check the batch arithmetic and fill in ``steps_per_generation``.

    ``steps_per_generation`` and ``generation_batch_size`` are alternatives; with neither,
    one generation batch feeds one optimizer step (``steps_per_generation`` = accumulation steps).
    A generation batch must hold whole groups; a group may straddle two processes (its
    advantages are computed from the rewards gathered over all of them).
    """
    if num_generations < 2:
        raise ValueError(
            f"num_generations must be at least 2 (advantages compare completions of a prompt), got {num_generations}"
        )
    if steps_per_generation is not None and generation_batch_size is not None:
        raise ValueError("set steps_per_generation or generation_batch_size, not both")
    if generation_batch_size is not None:
        per_step = per_device_batch_size * num_processes
        if generation_batch_size % per_step:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be divisible by per_device_train_batch_size × "
                f"processes ({per_device_batch_size} × {num_processes} = {per_step})"
            )
        steps_per_generation = generation_batch_size // per_step
    steps_per_generation = steps_per_generation or gradient_accumulation_steps
    if steps_per_generation < 1:
        raise ValueError(f"steps_per_generation must be at least 1, got {steps_per_generation}")
    layout = GenerationLayout(per_device_batch_size, num_processes, steps_per_generation, num_generations)
    if layout.generation_batch_size % num_generations:
        names, factors = ["per_device_train_batch_size", "steps_per_generation"], [per_device_batch_size]
        if num_processes > 1:
            names.insert(1, "processes")
            factors.append(num_processes)
        product = " × ".join(map(str, [*factors, steps_per_generation]))
        raise ValueError(
            f"{' × '.join(names)} ({product} = {layout.generation_batch_size}) must be divisible by "
            f"num_generations ({num_generations})"
        )
    return layout
