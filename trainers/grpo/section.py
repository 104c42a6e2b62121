"""GRPO's config section: its fields, their checks (rewards, objective options, and the batch layout
over the processes), and the key of its completions table in the trainer's logs. No torch here:
the experiment config and :class:`trainers.grpo.trainer.GRPOConfig` both take their GRPO fields from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Iterator, Literal, Union, get_args

from pydantic import Field, model_validator

from trainers.generation.budget import Generation
from trainers.generation.transfers import FOLDER_TRANSFERS, WeightTransferName
from trainers.grpo.layout import GenerationLayout, resolve_layout
from trainers.grpo.losses import (
    IMPORTANCE_LEVELS,
    POLICY_OBJECTIVES,
    AdvantageEstimatorName,
    GRPOLossName,
    ImportanceLevelName,
    PolicyObjectiveName,
    RewardScaleName,
)
from trainers.grpo.off_policy import MismatchCorrectionName
from trainers.grpo.rewards import RewardInputs, check_reward_names, reward_model_target
from trainers.sections import EvalStrategy, Placement, Seed, StageCompute, TrainingConfig, check_placement

if TYPE_CHECKING:
    from trainers.grpo.trainer import GRPOConfig

COMPLETIONS_LOG_KEY = "completions"  # a table (column -> values) in the trainer's logs; trackers render it
GenerationBackendName = Literal["hf", "vllm"]
VllmMode = Literal["colocate", "server"]


class GRPOStageConfig(TrainingConfig):
    num_train_epochs: float = Field(
        3.0, gt=0, description="Epochs over the GRPO prompts (each prompt `num_generations` times per epoch)."
    )
    per_device_train_batch_size: int = Field(
        128, ge=1, description="Completions per training step (prompts × `num_generations`)."
    )
    learning_rate: float = Field(1.5e-4, gt=0)
    logging_steps: int = Field(20, ge=1)
    eval_strategy: EvalStrategy = Field(
        "no", description="GRPO does not evaluate during training (the evaluation step scores its model): `no`."
    )
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
    loss_type: GRPOLossName = Field("dapo", description="How token losses are averaged (trainers/grpo/losses.py).")
    policy_loss: PolicyObjectiveName = Field(
        "clip",
        description="Per-token objective (trainers/grpo/losses.py): `clip` (PPO/GRPO clipped surrogate), "
        "`cispo` (MiniMax-M1), `sapo` (soft gate).",
    )
    importance_sampling_level: ImportanceLevelName = Field(
        "token", description="Importance ratio per token, or per completion, length-normalised (`sequence`: GSPO)."
    )
    sequence_epsilon: float = Field(
        3e-4, ge=0.0, description="GSPO clipping of the sequence ratio: s ≥ 1 − ε (GSPO paper: 3e-4)."
    )
    sequence_epsilon_high: float = Field(
        4e-4, ge=0.0, description="GSPO clipping of the sequence ratio: s ≤ 1 + ε_high (GSPO paper: 4e-4)."
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        description="Two-sided clipping (INTELLECT-2) of `clip`: the ratio is capped at δ for negative advantages; "
        "must exceed 1 + ε_high. Default: off.",
    )
    cispo_max_ratio: float | None = Field(
        None, gt=1.0, description="Cap ρ_max on CISPO's stopped-gradient importance weight; required by `cispo`."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="SAPO gate temperature τ for advantages > 0.")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="SAPO gate temperature τ for advantages ≤ 0.")
    use_bias_correction_kl: bool = Field(
        False,
        description="Weight k3 by π/π_old with its gradient (DeepSeek-V3.2): optimises KL(π ‖ ref) instead of the "
        "GRPO paper's plain k3, whose gradient is that of KL(ref ‖ π). Needs beta > 0.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Entropy bonus: subtract coef · H_t from each token's loss; 0 computes nothing."
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Train the policy term only on this top fraction of tokens by entropy (0.2 in Wang et al. 2025); "
        "1 = all tokens.",
    )
    advantage_estimator: AdvantageEstimatorName = Field(
        "grpo",
        description="Each reward's baseline: `grpo`, the group's mean; `rloo`, the mean of the prompt's other "
        "completions (RLOO; TRL's RLOOTrainer is `rloo` with scale_rewards: none).",
    )
    scale_rewards: RewardScaleName = Field("group", description="Advantage divisor: group std, batch std or none.")
    normalize_advantages: bool = Field(
        False,
        description="Normalise the advantages over the whole generation batch (mean 0, std 1) after the estimator "
        "and scale (TRL's RLOO option).",
    )
    use_kl_in_reward: bool = Field(
        False,
        description="Put the KL into the reward instead of the loss: r − β Σ_t (log π_old − log π_ref) over the "
        "completion's tokens, before the advantages (TRL's RLOOTrainer; verl's name). Needs beta > 0.",
    )
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["correctness"],
        min_length=1,
        description="Registered reward names, import paths `module:function`, or a reward model: `model:<stage>` "
        "(a reward stage of this experiment, e.g. `model:reward`) or `model:<path>`.",
    )
    reward_weights: list[float] | None = Field(None, description="One weight per reward function; default: all 1.")
    reward_model_device: Placement = Field(
        "policy",
        description="Where `model:` reward models score completions: `policy`, on each training process's device; "
        "`cpu`; or `cuda:N`, a GPU of their own that training does not use (one process).",
    )
    reward_inputs: RewardInputs = Field(
        "data",
        description="What reward functions receive as `prompts` and `completions`: `data`, as the data has them "
        "(TRL's contract: messages for conversational rows, strings for standard ones); `rendered`, the prompt as "
        "the chat template rendered it and the completion's text.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions without a stop token (EOS or end of turn) out of the loss."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    generation_seed: Seed | None = Field(
        None,
        description="Sample each completion with its own seed (this, the generation batch and the completion's "
        "place in it): the same completions whatever the number of processes or the batch shapes; one generate "
        "call per completion (slower). null: one seeded stream per process.",
    )
    max_prompt_length: int | None = Field(
        None, ge=1, description="Keep the last N prompt tokens; default: as prepared (`data.max_prompt_length`)."
    )
    max_completion_length: int = Field(6, ge=1, description="Generated tokens per completion at most.")
    generation_backend: GenerationBackendName = Field(
        "hf",
        description="What samples the completions: `hf`, the policy's own `generate`; `vllm`, a vLLM engine colocated "
        "in the training process, fed the policy's weights once per generation round (needs vLLM: `make install-vllm`, "
        "docs/algorithms/grpo.md).",
    )
    vllm_mode: VllmMode = Field(
        "colocate",
        description="vllm: `colocate`, an engine in the training process; `server`, a vLLM server of its own "
        "(other devices or machines): the one at vllm_server_url, or, without one, a server the train task starts "
        "on its machine for the stage and stops when the stage ends (docs/algorithms/grpo.md).",
    )
    vllm_server_url: str | None = Field(
        None,
        description="vllm server mode: the address of a running `alignflow vllm-server`; null: the train task "
        "starts one.",
    )
    vllm_server_gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="vllm server mode, a managed server: the GPU indices of this machine it runs on (its "
        "CUDA_VISIBLE_DEVICES), none of the training processes' (cuda:0 to cuda:num_processes-1); null: the "
        "devices it finds, shared with training.",
    )
    vllm_weight_transfer: WeightTransferName = Field(
        "storage",
        description="vllm server mode: how the policy's weights reach the server, at the first generation and after "
        "each round that changed them: `storage`, a "
        "safetensors file in vllm_transfer_folder and a reload call; `collective`, broadcast over a process group of "
        "the trainer and the server (NCCL between GPUs, gloo on CPUs; the server's port range must be reachable). "
        "With `collective` the server builds its engine from the model's config and receives the weights the same "
        "way: no shared storage needed.",
    )
    vllm_transfer_folder: str | None = Field(
        None,
        description="vllm server mode, storage transfer: a folder the trainer and the server both read (shared "
        "storage between machines, under the server's --weights-root); default: the stage's output folder's "
        "vllm-transfer/.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="vllm: the GPU memory share the engine may take (weights and KV cache)."
    )
    vllm_max_model_len: int | None = Field(
        None,
        ge=1,
        description="vllm: the longest prompt + completion; default: the model's context (max_position_embeddings, "
        "scaled by its rotary scaling factor as vLLM derives it).",
    )
    vllm_enable_sleep_mode: bool = Field(
        False, description="vllm: the engine gives its GPU memory back between generations (GPUs only)."
    )
    vllm_cpu_kv_cache_gib: int = Field(1, ge=1, description="vllm on a CPU: the KV cache's size in GiB.")
    max_staleness: int = Field(
        0,
        ge=0,
        description="Generation rounds the engine's weights may lag the trainer's: 0 is synchronous GRPO; k ≥ 1 "
        "samples the next k generation batches on the vLLM server (vllm_mode: server) while the trainer trains, "
        "each from the weights of up to k rounds before (docs/algorithms/grpo.md: Asynchronous GRPO).",
    )
    vllm_importance_sampling_cap: float | None = Field(
        None,
        ge=1.0,
        description="vllm: weight the loss by the ratio π_old / π_vllm bounded by this cap, the importance-sampling "
        "correction of the engine's and the trainer's mismatch as vllm_importance_sampling_mode says (TRL's "
        "vllm_importance_sampling_clip_max); null: off.",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None,
        ge=0.0,
        description="vllm: the importance-sampling correction's lower bound (TRL's name): ratios below it are "
        "raised to it (`*_truncate`) or dropped (`*_mask`); null: none.",
    )
    vllm_importance_sampling_mode: MismatchCorrectionName = Field(
        "token_truncate",
        description="vllm: how vllm_importance_sampling_cap bounds the π_old / π_vllm ratio (TRL's names; "
        "trainers/grpo/off_policy.py): per token, or per completion (`sequence_*`: its whole likelihood ratio), "
        "truncated at the cap (`*_truncate`, TIS) or dropped above it (`*_mask`, MIS).",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0.0,
        description="Leave out of the loss each completion with a negative advantage whose mean log π_old − log π "
        "per token exceeds this (DeepSeek-V3.2's off-policy sequence mask, TRL's name); null: off.",
    )
    log_completions_steps: int = Field(
        100, ge=0, description="Log a table of sample completions every N steps; 0 = never."
    )
    num_completions_to_log: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check_rewards(self) -> GRPOStageConfig:
        check_reward_names(self.reward_funcs, self.reward_weights)
        if self.reward_inputs != "data" and any(reward_model_target(f) for f in self.reward_funcs):
            raise ValueError(
                "reward_inputs: a reward model (model:…) scores prompts and completions as the data has them; "
                "use reward_inputs: data"
            )
        return self

    @property
    def starts_generation_server(self) -> bool:
        """vLLM server mode without a server's address: the train task starts one for the stage."""
        return self.generation_backend == "vllm" and self.vllm_mode == "server" and self.vllm_server_url is None

    @model_validator(mode="after")
    def _check_engine_options(self) -> GRPOStageConfig:
        check_engine_options(self)
        return self

    @model_validator(mode="after")
    def _no_evaluation_during_training(self) -> GRPOStageConfig:
        if self.eval_strategy != "no" or self.eval_steps is not None:
            raise ValueError(
                "GRPO does not evaluate during training (the pipeline's evaluation step scores its model): "
                "leave eval_strategy: no and eval_steps unset"
            )
        return self

    @model_validator(mode="after")
    def _check_policy_options(self) -> GRPOStageConfig:
        check_policy_options(self)
        return self


# What the checks and derivations below read: the section, or the trainer's arguments built from it.
GRPOOptions = Union[GRPOStageConfig, "GRPOConfig"]


def generation_layout(options: GRPOOptions, num_processes: int) -> GenerationLayout:
    """The generation layout of a section or a ``GRPOConfig`` over ``num_processes`` processes in
    all (:func:`~trainers.grpo.layout.resolve_layout`: raises when the batch arithmetic does not divide)."""
    return resolve_layout(
        per_device_batch_size=options.per_device_train_batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        num_generations=options.num_generations,
        num_processes=num_processes,
        steps_per_generation=options.steps_per_generation,
        generation_batch_size=options.generation_batch_size,
    )


def grpo_generation(options: GRPOOptions) -> Generation:
    """The completions a section or a ``GRPOConfig`` samples: ``max_completion_length`` tokens after
    prompts cut to ``max_prompt_length``, within ``vllm_max_model_len`` where vLLM generates and it
    is set."""
    return Generation(
        new_tokens=options.max_completion_length,
        setting="grpo.max_completion_length",
        max_prompt_length=options.max_prompt_length,
        prompt_settings="data.max_prompt_length or grpo.max_prompt_length",
        engine_length=options.vllm_max_model_len if options.generation_backend == "vllm" else None,
        engine_setting="grpo.vllm_max_model_len",
    )


def check_grpo_compute(section: GRPOStageConfig, compute: StageCompute) -> None:
    """The stage's load-time check: the layout over ``compute.num_processes``, as the trainer
    resolves it over its world size, so one that does not divide over the processes is a config
    error instead of a failure in the ranks after the stages before GRPO have trained; a managed
    vLLM server on one machine; a reward model's GPU of its own, too."""
    try:
        generation_layout(section, compute.num_processes)
    except ValueError as error:
        raise ValueError(f"batch layout over compute.num_processes ({compute.num_processes}): {error}") from None
    if section.starts_generation_server and compute.num_machines > 1:
        raise ValueError(
            f"vllm_mode server without vllm_server_url starts a server on the train task's machine, which the ranks "
            f"on the other machines cannot reach (compute.num_machines is {compute.num_machines}): start "
            "`alignflow vllm-server` on a machine they all reach and give its address"
        )
    check_placement("reward_model_device", section.reward_model_device, compute)
    check_server_gpus(section, compute)


def check_server_gpus(section: GRPOStageConfig, compute: StageCompute) -> None:
    """A managed server's GPUs of its own are none of the training processes' (``cuda:0`` to
    ``cuda:num_processes-1``): an engine and a policy on one GPU do not both fit its memory."""
    shared = sorted(set(section.vllm_server_gpus or ()) & set(range(compute.num_processes)))
    if shared:
        raise ValueError(
            f"vllm_server_gpus {section.vllm_server_gpus}: GPU {', '.join(map(str, shared))} also trains "
            f"(compute.num_processes {compute.num_processes} uses GPUs 0 to {compute.num_processes - 1}); give the "
            f"server GPUs from {compute.num_processes} on"
        )


# The vllm_* options that only some values of a setting read, by setting (checked in this order)
# and value: away from its default, such an option has no effect where the setting has another value.
READ_ONLY_BY: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm_mode": {
        "colocate": ("vllm_enable_sleep_mode",),  # a server keeps its devices to itself
        "server": ("vllm_server_url", "vllm_weight_transfer", "vllm_transfer_folder", "vllm_server_gpus"),
    },
    # the other transfers carry the model and its weights themselves
    "vllm_weight_transfer": {
        name: ("vllm_transfer_folder",) if name in FOLDER_TRANSFERS else () for name in get_args(WeightTransferName)
    },
}

# What the importance-sampling correction reads beside its cap (null: the correction is off).
CORRECTION_OPTIONS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min")


def unread_engine_options(options: GRPOOptions) -> Iterator[tuple[str, str]]:
    """The ``vllm_*`` options that ``options`` leaves unread, each with the setting that says so."""
    if options.generation_backend != "vllm":
        because = f"generation_backend {options.generation_backend!r}"
        yield from ((name, because) for name in GRPOStageConfig.model_fields if name.startswith("vllm_"))
        return
    for setting, readers in READ_ONLY_BY.items():
        value = getattr(options, setting)
        for other, fields in readers.items():
            if other != value:
                yield from ((field, f"{setting} {value!r}") for field in fields if field not in readers[value])
    if options.vllm_importance_sampling_cap is None:  # the correction is off: its other options unread
        yield from ((field, "vllm_importance_sampling_cap null") for field in CORRECTION_OPTIONS)


def check_engine_options(options: GRPOOptions) -> None:
    """A ``vllm_*`` option away from its default has no effect unless vLLM generates, nor one that
    only another value of a setting reads (:data:`READ_ONLY_BY`), nor one of the importance-sampling
    correction's without its cap (:data:`CORRECTION_OPTIONS`)."""
    for field, because in unread_engine_options(options):
        value, default = getattr(options, field), GRPOStageConfig.model_fields[field].default
        if value != default:
            raise ValueError(f"{field}: {value} has no effect with {because}")
    if options.max_staleness and (options.generation_backend != "vllm" or options.vllm_mode != "server"):
        raise ValueError(
            f"max_staleness: {options.max_staleness} samples ahead on a vLLM server: it needs generation_backend "
            "vllm with vllm_mode server"
        )
    if options.max_staleness and options.vllm_importance_sampling_cap is None:
        raise ValueError(
            f"max_staleness: {options.max_staleness} trains on samples of older weights, which needs the "
            "importance-sampling correction: set vllm_importance_sampling_cap"
        )
    low, cap = options.vllm_importance_sampling_clip_min, options.vllm_importance_sampling_cap
    if low is not None and cap is not None and low >= cap:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({low}) must be below vllm_importance_sampling_cap ({cap})"
        )


def objective_fields() -> set[str]:
    """The section fields some registered objective or importance level reads."""
    fields = set().union(*(objective.hyperparameters for objective in POLICY_OBJECTIVES.values()))
    return fields.union(*(level.clip_range for level in IMPORTANCE_LEVELS.values()))


def check_policy_options(options: GRPOOptions) -> None:
    """Cross-field checks of the objective options, for the section and for a ``GRPOConfig`` built
    directly: a hyperparameter the chosen objective (at the chosen importance level) does not
    read may not be set away from its default, one it requires may not be missing, δ must lie
    above the clip range, and the KL bias correction needs a KL term."""
    objective = POLICY_OBJECTIVES.lookup(options.policy_loss)
    level = IMPORTANCE_LEVELS.lookup(options.importance_sampling_level)
    unknown = sorted(objective_fields() - GRPOStageConfig.model_fields.keys())
    if unknown:
        raise ValueError(f"GRPO objectives or importance levels read {unknown}, which are not fields of the section")
    reads = set(objective.hyperparameters) | (set(level.clip_range) if objective.clip_range else set())
    chosen = f"policy_loss {objective.name!r} at importance_sampling_level {level.name!r}"
    for field in sorted(objective_fields() - reads):
        value, default = getattr(options, field), GRPOStageConfig.model_fields[field].default
        if value != default:
            raise ValueError(f"{field}: {value} has no effect with {chosen}")
    for field in sorted(objective.required):
        if getattr(options, field) is None:
            raise ValueError(f"{chosen} needs {field}")
    if options.delta is not None:
        upper = getattr(options, level.clip_range[1])
        upper = getattr(options, level.clip_range[0]) if upper is None else upper
        if options.delta <= 1 + upper:
            raise ValueError(f"delta ({options.delta}) must exceed 1 + {level.clip_range[1]} ({1 + upper})")
    if options.use_bias_correction_kl and options.beta == 0:
        raise ValueError("use_bias_correction_kl needs beta > 0 (there is no KL term with beta = 0)")
    if options.use_kl_in_reward and options.beta == 0:
        raise ValueError("use_kl_in_reward needs beta > 0, the coefficient of the KL it subtracts from the reward")
    if options.use_kl_in_reward and options.use_bias_correction_kl:
        raise ValueError("use_bias_correction_kl weights the loss's k3 term; with use_kl_in_reward the loss has none")
