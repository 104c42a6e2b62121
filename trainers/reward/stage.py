"""The reward model: a one-logit sequence classifier trained on the `preference` split's pairs with
the Bradley–Terry loss, from the model the stage starts from. Its model does not become the next
stage's policy: GRPO names it as a reward function (``grpo.reward_funcs: [model:reward]``)."""

from __future__ import annotations

from trainers.reward.section import RewardStageConfig
from trainers.stages.spec import StageInputs, StageSpec, register_stage


def build_reward(section: RewardStageConfig, inputs: StageInputs):
    from trainers.models.lora import add_adapters
    from trainers.reward.trainer import PairSequenceCollator, RewardConfig, RewardTrainer
    from trainers.scoring.reward_model import REWARD_HEADS, load_reward_model

    policy = inputs.policy
    base, tokenizer, _ = load_reward_model(
        policy.path, policy.revision, inputs.dtype, section.head, chat_template=inputs.chat_template
    )
    # with LoRA: saved merged (trainers.models.lora.save_stage_model), as a full reward model is
    head = REWARD_HEADS.lookup(section.head)
    model = base if inputs.lora is None else add_adapters(base, inputs.lora, head.peft_task_type)
    return RewardTrainer(
        data_collator=PairSequenceCollator(tokenizer.pad_token_id),
        **inputs.trainer_arguments(section, RewardConfig, model, tokenizer, "preference", "preference_eval"),
    )


REWARD = register_stage(
    StageSpec(
        name="reward",
        section=RewardStageConfig,
        splits=("preference",),
        build=build_reward,
        produces="reward_model",
        curves=("loss", "accuracy"),
        description="A reward model (one-logit sequence classifier, Bradley–Terry loss) on the `preference` split's "
        "pairs, from the current policy; later stages score with it (`grpo.reward_funcs: [model:reward]`), the "
        "policy passes it by.",
    )
)
