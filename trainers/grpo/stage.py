"""GRPO: group-relative policy optimisation on prompts, rewarded by the registered reward functions
and reward models (``model:<reward stage or path>``)."""

from __future__ import annotations

from trainers.generation.transfers import FOLDER_TRANSFERS
from trainers.grpo.rewards import reward_model_target
from trainers.grpo.section import COMPLETIONS_LOG_KEY, GRPOStageConfig, check_grpo_compute, grpo_generation
from trainers.stages.spec import GenerationServer, StageInputs, StageSpec, register_stage


def reward_functions(section: GRPOStageConfig, inputs: StageInputs, policy_device) -> list:
    """``reward_funcs`` with each ``model:…`` reward (an earlier reward stage's model, or a path)
    loaded where ``reward_model_device`` places it: on ``policy_device``, or a device of its own."""
    from trainers.models.devices import placed_on
    from trainers.scoring.reward_model import load_scorer

    targets = [(name, reward_model_target(name)) for name in section.reward_funcs]  # in order, repeats kept
    device = None
    if any(target is not None for _, target in targets):  # without a model, no device to check
        device = placed_on(section.reward_model_device, policy_device, "grpo.reward_model_device")
    functions: list = []
    for name, target in targets:
        if target is None:
            functions.append(name)
            continue
        source = inputs.reward_models.get(target)
        path, revision = (source.path, source.revision) if source is not None else (target, None)
        functions.append(load_scorer(path, revision, inputs.dtype, device, name, inputs.padding_free))
    return functions


def build_grpo(section: GRPOStageConfig, inputs: StageInputs):
    from trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    model, tokenizer = inputs.load_policy()
    # The KL anchor is the policy GRPO starts from (with LoRA: the policy, adapters disabled);
    # with β = 0 no reference is loaded at all.
    ref_model = inputs.load_reference() if section.beta > 0 else None
    arguments = inputs.trainer_arguments(section, GRPOConfig, model, tokenizer, "grpo_prompts")
    return GRPOTrainer(
        ref_model=ref_model,
        reward_funcs=reward_functions(section, inputs, arguments["args"].device),
        **arguments,
    )


def generation_server(section: GRPOStageConfig) -> GenerationServer | None:
    """The vLLM server the train task starts for ``vllm_mode: server`` without a server's address."""
    if not section.starts_generation_server:
        return None

    def served(url: str, folder: str | None) -> GRPOStageConfig:
        return section.model_copy(
            update={"vllm_server_url": url, **({"vllm_transfer_folder": folder} if folder else {})}
        )

    through_folder = section.vllm_weight_transfer in FOLDER_TRANSFERS
    return GenerationServer(uses_folder=through_folder, gpus=section.vllm_server_gpus, served=served)


GRPO = register_stage(
    StageSpec(
        name="grpo",
        section=GRPOStageConfig,
        splits=("grpo_prompts",),
        build=build_grpo,
        check=check_grpo_compute,
        generation=grpo_generation,
        generation_server=generation_server,
        completions_table=COMPLETIONS_LOG_KEY,
        reward_models=lambda section: tuple(t for f in section.reward_funcs if (t := reward_model_target(f))),
        description="Group-relative policy optimisation on the `grpo_prompts` split, rewarded by `reward_funcs` "
        "(registered functions, import paths, reward models).",
        curves=("reward", "completions/mean_length"),
    )
)
