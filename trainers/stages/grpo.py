"""GRPO: group-relative policy optimisation on prompts, rewarded by the registered reward functions."""

from __future__ import annotations

from pydantic import Field, model_validator

from trainers.grpo_losses import GRPOLossName, RewardScaleName
from trainers.layout import resolve_layout
from trainers.rewards import resolve_rewards
from trainers.sections import TrainingConfig
from trainers.stages.registry import StageInputs, StageSpec, register_stage

COMPLETIONS_LOG_KEY = "completions"  # a table (column -> values) in the trainer's logs; trackers render it


class GRPOStageConfig(TrainingConfig):
    num_train_epochs: float = Field(
        3.0, gt=0, description="Epochs over the GRPO prompts (each prompt `num_generations` times per epoch)."
    )
    per_device_train_batch_size: int = Field(
        128, ge=1, description="Completions per training step (prompts × `num_generations`)."
    )
    learning_rate: float = Field(1.5e-4, gt=0)
    logging_steps: int = Field(20, ge=1)
    num_generations: int = Field(8, ge=2, description="Completions per prompt (G).")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Training steps served by one generation batch; default: `gradient_accumulation_steps`."
    )
    generation_batch_size: int | None = Field(
        None,
        ge=2,
        description="Completions per generation batch (all processes); alternative to `steps_per_generation`.",
    )
    num_iterations: int = Field(1, ge=1, description="Optimisation passes (μ) over each generation batch.")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient to the starting policy; 0 loads no reference model.")
    epsilon: float = Field(0.2, ge=0.0, description="Clipping: ρ ≥ 1 − ε.")
    epsilon_high: float | None = Field(None, ge=0.0, description="Clipping: ρ ≤ 1 + ε_high; default: `epsilon`.")
    loss_type: GRPOLossName = Field("dapo", description="How token losses are averaged (trainers/grpo_losses.py).")
    scale_rewards: RewardScaleName = Field("group", description="Advantage divisor: group std, batch std or none.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["correctness"],
        min_length=1,
        description="Registered reward names or import paths `module:function`.",
    )
    reward_weights: list[float] | None = Field(None, description="One weight per reward function; default: all 1.")
    mask_truncated_completions: bool = Field(False, description="Leave completions without EOS out of the loss.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_prompt_length: int | None = Field(
        None, ge=1, description="Keep the last N prompt tokens; default: as prepared (`data.max_prompt_length`)."
    )
    max_completion_length: int = Field(6, ge=1, description="Generated tokens per completion at most.")
    log_completions_steps: int = Field(
        100, ge=0, description="Log a table of sample completions every N steps; 0 = never."
    )
    num_completions_to_log: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check_rewards_and_generation_layout(self) -> GRPOStageConfig:
        resolve_rewards(self.reward_funcs, self.reward_weights)
        resolve_layout(
            per_device_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_generations=self.num_generations,
            steps_per_generation=self.steps_per_generation,
            generation_batch_size=self.generation_batch_size,
        )
        return self


def build_grpo(section: GRPOStageConfig, inputs: StageInputs):
    from trainers.grpo import GRPOConfig, GRPOTrainer
    from trainers.modeling import load_causal_lm

    model, tokenizer = load_causal_lm(inputs.policy.path, inputs.policy.revision)
    # The KL anchor is the policy GRPO starts from; with β = 0 no reference is loaded at all.
    ref_model = load_causal_lm(inputs.reference.path, inputs.reference.revision)[0] if section.beta > 0 else None
    return GRPOTrainer(
        model=model,
        ref_model=ref_model,
        args=section.training_arguments(GRPOConfig, **inputs.runtime_arguments()),
        train_dataset=inputs.splits["grpo_prompts"],
        processing_class=tokenizer,
        callbacks=inputs.callbacks,
    )


GRPO = register_stage(
    StageSpec(
        name="grpo",
        section=GRPOStageConfig,
        split="grpo_prompts",
        build=build_grpo,
        description="Group-relative policy optimisation on the `grpo_prompts` split, rewarded by `reward_funcs`.",
    )
)
