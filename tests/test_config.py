import sys

import pytest
import yaml
from pydantic import ValidationError

from infra.core.config import ExperimentConfig, config_errors, did_you_mean, load_config, merge_onto
from infra.ops.cli import main
from trainers.dpo.losses import PREFERENCE_LOSSES
from trainers.evaluation.evaluate import GenerationSpec
from trainers.grpo.rewards import REWARD_FUNCTIONS

pytestmark = pytest.mark.unit


def test_yaml_and_cli_overrides():
    config = load_config("configs/default.yaml", ["dpo.beta=0.2", "sft.num_train_epochs=3", "stages=[sft]"])
    assert config.dpo.beta == 0.2
    assert config.sft.num_train_epochs == 3
    assert config.stages == ["sft"]
    assert config.flat()["dpo.beta"] == 0.2
    assert config.content_hash() != load_config("configs/default.yaml").content_hash()


def test_unknown_fields_and_bad_values_are_rejected():
    with pytest.raises(ValidationError, match="bta"):
        load_config(None, ["dpo.bta=0.2"])
    with pytest.raises(ValidationError, match="beta"):
        load_config(None, ["dpo.beta=-1"])
    with pytest.raises(ValidationError, match="needs data.preference"):
        ExperimentConfig.model_validate({"data": {"builtin": None}, "stages": ["dpo"]})
    with pytest.raises(ValueError, match="key.sub=value"):
        load_config(None, ["dpo.beta"])


def test_schema_has_descriptions_for_the_ui():
    schema = ExperimentConfig.model_json_schema()
    assert "DPOStageConfig" in schema["$defs"]
    dpo = schema["$defs"]["DPOStageConfig"]["properties"]
    assert dpo["reference"]["enum"] == ["cached", "live", "none"]
    assert "description" in dpo["beta"]
    assert sorted(dpo["loss_type"]["anyOf"][0]["enum"]) == sorted(PREFERENCE_LOSSES)


def test_dpo_defaults_and_loss_options():
    dpo = load_config(None).dpo
    assert (dpo.beta, dpo.loss_type, dpo.loss_weights, dpo.label_smoothing, dpo.reference) == (
        0.1,
        "sigmoid",
        None,
        0.0,
        "cached",
    )
    combined = load_config(None, ["dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1.0, 0.2]"]).dpo
    assert combined.loss_type == ["sigmoid", "sft"] and combined.loss_weights == [1.0, 0.2]
    assert load_config(None, ["dpo.reference=live", "dpo.sync_ref_model=true"]).dpo.sync_ref_model
    assert (dpo.use_weighting, dpo.ld_alpha, dpo.f_divergence_type) == (False, None, "reverse_kl")


@pytest.mark.parametrize(
    "overrides",
    [
        ["dpo.loss_type=aot", "dpo.label_smoothing=0.1"],
        ["dpo.loss_type=aot_pair"],
        ["dpo.loss_type=f_divergence", "dpo.f_divergence_type=alpha_divergence", "dpo.f_alpha=0.3"],
        ["dpo.loss_type=simpo", "dpo.beta=2.0", "dpo.simpo_gamma=1.0"],
        ["dpo.loss_type=cpo", "dpo.cpo_alpha=0.5"],
        ["dpo.loss_type=orpo", "dpo.orpo_lambda=0.2", "dpo.reference=none"],
        ["dpo.loss_type=[simpo, sft]", "dpo.loss_weights=[1.0, 0.1]", "dpo.use_weighting=true", "dpo.ld_alpha=0.5"],
    ],
)
def test_new_dpo_objectives_load_with_their_hyperparameters(overrides):
    dpo = load_config(None, overrides).dpo
    for override in overrides:
        field, value = override.removeprefix("dpo.").split("=")
        assert getattr(dpo, field) == yaml.safe_load(value), field


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dpo.loss_type=nope"], "dpo.loss_type"),
        (["dpo.loss_type=[sigmoid, nope]"], "dpo.loss_type"),
        (["dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1.0]"], "loss_weights: 1 weights for 2 losses"),
        (["dpo.loss_type=[ipo, ipo]"], "repeats a loss"),
        (["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"], "label_smoothing: 0.1 has no effect"),
        (["dpo.label_smoothing=0.5"], "label_smoothing"),
        (["dpo.sync_ref_model=true"], "sync_ref_model needs reference: live"),
        (["dpo.reference=none", "dpo.sync_ref_model=true"], "sync_ref_model needs reference: live"),
        # the objectives of issue 17: unknown names, missing and invalid hyperparameters
        (["dpo.loss_type=simpoo"], "dpo.loss_type"),
        (["dpo.loss_type=f_divergence", "dpo.f_divergence_type=hellinger"], "f_divergence_type"),
        (["dpo.loss_type=f_divergence", "dpo.f_divergence_type=null"], "f_divergence_type"),
        (["dpo.loss_type=f_divergence", "dpo.f_alpha=0.3"], "f_alpha: 0.3 has no effect with f_divergence_type"),
        (["dpo.loss_type=f_divergence", "dpo.f_divergence_type=alpha_divergence", "dpo.f_alpha=0"], "f_alpha"),
        (["dpo.loss_type=simpo", "dpo.simpo_gamma=-1"], "simpo_gamma"),
        (["dpo.loss_type=simpo", "dpo.simpo_gamma=null"], "simpo_gamma"),
        (["dpo.loss_type=sigmoid", "dpo.simpo_gamma=1.0"], "simpo_gamma: 1.0 has no effect"),
        (["dpo.loss_type=cpo", "dpo.cpo_alpha=-0.5"], "cpo_alpha"),
        (["dpo.loss_type=orpo", "dpo.orpo_lambda=0"], "orpo_lambda"),
        (["dpo.loss_type=orpo", "dpo.cpo_alpha=2"], "cpo_alpha: 2.0 has no effect"),
        (["dpo.ld_alpha=1.5"], "ld_alpha"),
        (["dpo.use_weighting=maybe"], "use_weighting"),
        # WPO's pair weights on a loss that sorts the batch: the loss would depend on the pairs' order
        (
            ["dpo.loss_type=aot_pair", "dpo.use_weighting=true"],
            r"use_weighting: WPO weights pair i's loss, and \['aot_pair'\] sort",
        ),
        (["dpo.loss_type=[sigmoid, aot]", "dpo.use_weighting=true"], r"\['aot'\] sort the batch"),
        (["dpo.loss_type=simpo", "dpo.reference=live"], "reference: live loads a reference model"),
        (["dpo.loss_type=[cpo, sft]", "dpo.reference=live", "dpo.sync_ref_model=true"], "reference: live loads"),
    ],
)
def test_invalid_dpo_options_are_config_errors(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, overrides)


def test_grpo_layout_is_checked_over_the_compute_sections_processes():
    """The trainer resolves the layout over its world size (compute.num_processes): one that
    divides on one process but not on two fails when the config loads, not in the ranks."""
    layout = ["grpo.per_device_train_batch_size=8", "grpo.num_generations=4", "grpo.generation_batch_size=24"]
    assert load_config(None, layout).grpo.generation_batch_size == 24
    with pytest.raises(ValidationError) as error:
        load_config(None, [*layout, "compute.num_processes=2"])
    assert config_errors(error.value) == [
        (
            "",
            "grpo: batch layout over compute.num_processes (2): generation_batch_size (24) must be divisible by "
            "per_device_train_batch_size × processes (8 × 2 = 16)",
        )
    ]
    divides = [*layout[:2], "grpo.generation_batch_size=32", "compute.num_processes=2"]
    assert load_config(None, divides).grpo.generation_batch_size == 32
    # Groups may straddle processes: 3 completions per process and step are whole groups of 2 over 2 processes.
    odd = ["grpo.per_device_train_batch_size=3", "grpo.num_generations=2"]
    with pytest.raises(ValidationError, match=r"per_device_train_batch_size × steps_per_generation \(3 × 1 = 3\)"):
        load_config(None, odd)
    assert load_config(None, [*odd, "compute.num_processes=2"]).grpo.per_device_train_batch_size == 3
    # A stage that does not run is not checked.
    assert load_config(None, [*layout, "compute.num_processes=2", "stages=[sft, dpo]"]).stages == ["sft", "dpo"]


def test_grpo_stage_is_checked_when_the_config_loads():
    assert load_config("configs/default.yaml").stages == ["sft", "dpo", "grpo"]
    with pytest.raises(
        ValidationError,
        match=(
            r"per_device_train_batch_size × steps_per_generation \(128 "
            r"× 1 = 128\) must be divisible by num_generations \(3\)"
        ),
    ):
        load_config(None, ["grpo.num_generations=3"])
    with pytest.raises(ValidationError, match="set steps_per_generation or generation_batch_size, not both"):
        load_config(None, ["grpo.steps_per_generation=2", "grpo.generation_batch_size=256"])
    with pytest.raises(ValidationError, match="reward_weights has 2 values for 1 reward_funcs"):
        load_config(None, ["grpo.reward_weights=[1, 2]"])
    with pytest.raises(ValidationError, match="unknown reward function 'corectness'"):
        load_config(None, ["grpo.reward_funcs=[corectness]"])
    with pytest.raises(ValidationError, match="loss_type"):
        load_config(None, ["grpo.loss_type=ppo"])
    with pytest.raises(ValidationError, match="needs data.grpo_prompts"):
        ExperimentConfig.model_validate(
            {"data": {"builtin": None, "sft": {"path": "org/sft-rows"}}, "stages": ["sft", "grpo"]}
        )
    assert load_config(None, ["stages=[sft, grpo]"]).stages == ["sft", "grpo"]


@pytest.mark.parametrize(
    "override",
    [
        "sft.learning_rate=-1",
        "sft.num_train_epochs=0",
        "dpo.num_train_epochs=0",
        "grpo.learning_rate=0",
        "dpo.logging_steps=0",
    ],
)
def test_stage_defaults_keep_the_shared_constraints(override):
    with pytest.raises(ValidationError, match=override.split("=")[0].split(".")[1]):
        load_config(None, [override])


PLUGIN = '''
from trainers.dpo.losses import register_loss
from trainers.grpo.rewards import register_reward


@register_loss("plugin_margin", hyperparameters=("beta",))
def plugin_margin(pairs, params):
    """L = −β·Δ"""
    return -params.beta * pairs.margin


@register_reward("plugin_length")
def plugin_length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An importable plugin module; its registrations are removed afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "alignflow_test_plugin.py").write_text(PLUGIN)
    yield "alignflow_test_plugin"
    PREFERENCE_LOSSES.pop("plugin_margin", None)
    REWARD_FUNCTIONS.pop("plugin_length", None)
    sys.modules.pop("alignflow_test_plugin", None)


def test_a_plugin_module_registers_losses_and_rewards_that_the_config_then_accepts(plugin):
    overrides = ["dpo.loss_type=plugin_margin", "grpo.reward_funcs=[plugin_length]"]
    with pytest.raises(ValidationError, match="unknown loss_type 'plugin_margin'"):
        load_config(None, overrides)
    config = load_config(None, [f"plugins=[{plugin}]", *overrides])
    assert (config.dpo.loss_type, config.grpo.reward_funcs) == ("plugin_margin", ["plugin_length"])
    with pytest.raises(
        ValidationError, match="plugins: cannot import 'no_such_plugin': .* put its folder on PYTHONPATH"
    ):
        load_config(None, ["plugins=[no_such_plugin]"])
    loss_choices = ExperimentConfig.model_json_schema()["$defs"]["DPOStageConfig"]["properties"]["loss_type"]
    assert "plugin_margin" in loss_choices["anyOf"][0]["enum"]  # the UI form lists it from now on


def test_a_standalone_evaluation_imports_its_plugins_before_it_validates(plugin):
    from infra.core.config import EvaluationRequest

    request = EvaluationRequest.model_validate({"models": {"base": "builtin:tiny-llama"}, "plugins": [plugin]})
    assert request.plugins == [plugin] and plugin in sys.modules
    with pytest.raises(ValidationError, match="plugins: 'my plugin' is not a module name"):
        EvaluationRequest.model_validate({"models": {"base": "builtin:tiny-llama"}, "plugins": ["my plugin"]})


def test_unknown_keys_get_the_nearest_known_keys_of_their_section():
    with pytest.raises(ValidationError) as raised:
        load_config(None, ["dpo.bta=0.2", "data.max_lenght=3", "dataa={}", "zzz=1"])
    assert sorted(did_you_mean(raised.value, ExperimentConfig)) == [
        "unknown key data.max_lenght: did you mean data.max_length, data.max_prompt_length?",
        "unknown key dataa: did you mean data?",
        "unknown key dpo.bta: did you mean dpo.beta?",
    ]


def test_print_config_prints_the_resolved_config_and_runs_nothing(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", "configs/minimal.yaml", "dpo.beta=0.3", "--print-config"])
    assert exited.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == load_config("configs/minimal.yaml", ["dpo.beta=0.3"]).model_dump(
        mode="json"
    )


def test_a_partial_config_keeps_every_default_it_does_not_set():
    defaults = load_config("configs/minimal.yaml").model_dump(mode="json")
    partial = ExperimentConfig.model_validate({"name": "partial", "dpo": {"beta": 0.25}})
    merged = merge_onto(partial, defaults)
    assert (merged.name, merged.dpo.beta) == ("partial", 0.25)
    assert merged.model_dump(exclude={"name": True, "dpo": {"beta"}}) == load_config("configs/minimal.yaml").model_dump(
        exclude={"name": True, "dpo": {"beta"}}
    )
    full = load_config("configs/minimal.yaml")
    assert merge_onto(full, defaults) == full


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.policy_loss=ppo"], "unknown policy_loss 'ppo'"),
        (["grpo.importance_sampling_level=segment"], "unknown importance_sampling_level 'segment'"),
        (["grpo.policy_loss=cispo"], "policy_loss 'cispo' at importance_sampling_level 'token' needs cispo_max_ratio"),
        (["grpo.policy_loss=cispo", "grpo.cispo_max_ratio=1"], "cispo_max_ratio"),
        (["grpo.sequence_epsilon=0.001"], "sequence_epsilon: 0.001 has no effect with policy_loss 'clip' at"),
        (["grpo.importance_sampling_level=sequence", "grpo.epsilon=0.3"], "epsilon: 0.3 has no effect"),
        (["grpo.policy_loss=sapo", "grpo.epsilon_high=0.28"], "epsilon_high: 0.28 has no effect"),
        (["grpo.policy_loss=sapo", "grpo.delta=2"], "delta: 2.0 has no effect with policy_loss 'sapo'"),
        (["grpo.sapo_temperature_neg=2"], "sapo_temperature_neg: 2.0 has no effect with policy_loss 'clip'"),
        (["grpo.cispo_max_ratio=5"], "cispo_max_ratio: 5.0 has no effect"),
        (["grpo.delta=1.1"], r"delta \(1.1\) must exceed 1 \+ epsilon_high \(1.2\)"),
        (["grpo.delta=0.5"], "delta"),
        (["grpo.use_bias_correction_kl=true"], "use_bias_correction_kl needs beta > 0"),
        (["grpo.top_entropy_quantile=1.5"], "top_entropy_quantile"),
        (["grpo.entropy_coef=-0.1"], "entropy_coef"),
    ],
)
def test_invalid_grpo_objective_options_are_config_errors(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, overrides)


def test_the_generation_backend_and_its_engine_options():
    assert (load_config(None).grpo.generation_backend, load_config(None).evaluation.generation_backend) == ("hf", "hf")
    assert load_config(None, ["evaluation.generation_backend=vllm"]).evaluation.generation() == GenerationSpec(
        5, 4, 1.0, 256, 0, "vllm"
    )
    vllm = load_config(None, ["grpo.generation_backend=vllm", "grpo.vllm_importance_sampling_cap=2"]).grpo
    server = ["grpo.generation_backend=vllm", "grpo.vllm_mode=server"]
    managed, external = (load_config(None, o).grpo for o in [server, [*server, "grpo.vllm_server_url=u"]])
    assert [section.starts_generation_server for section in (vllm, managed, external)] == [False, True, False]
    # a server serves any number of training processes; one they all reach, any number of machines
    two_machines = ["compute.num_processes=2", "compute.num_machines=2", "compute.main_process_ip=10.0.0.1"]
    assert load_config(None, [*server, "compute.num_processes=2"]).compute.num_processes == 2
    assert load_config(None, [*server, "grpo.vllm_server_url=u", *two_machines]).compute.num_machines == 2
    assert (vllm.generation_backend, vllm.vllm_importance_sampling_cap, vllm.vllm_gpu_memory_utilization) == (
        "vllm",
        2.0,
        0.3,
    )
    refused = {
        "vllm_gpu_memory_utilization: 0.5 has no effect with generation_backend 'hf'": [
            "grpo.vllm_gpu_memory_utilization=0.5"
        ],
        "vllm_importance_sampling_cap: 2.0 has no effect": ["grpo.vllm_importance_sampling_cap=2"],
        "vllm_importance_sampling_mode: sequence_mask has no effect with vllm_importance_sampling_cap null": [
            "grpo.generation_backend=vllm",
            "grpo.vllm_importance_sampling_mode=sequence_mask",
        ],
        "unknown vllm_importance_sampling_mode 'sequence'": ["grpo.vllm_importance_sampling_mode=sequence"],
        "vllm_importance_sampling_clip_min \\(3.0\\) must be below vllm_importance_sampling_cap \\(2.0\\)": [
            "grpo.generation_backend=vllm",
            "grpo.vllm_importance_sampling_cap=2",
            "grpo.vllm_importance_sampling_clip_min=3",
        ],
        "unknown generation_backend 'sglang'|Input should be 'hf' or 'vllm'": ["grpo.generation_backend=sglang"],
        "vllm_server_url: http://gen:8000 has no effect with vllm_mode 'colocate'": [
            "grpo.generation_backend=vllm",
            "grpo.vllm_server_url=http://gen:8000",
        ],
        "vllm_enable_sleep_mode: True has no effect with vllm_mode 'server'": [
            "grpo.generation_backend=vllm",
            "grpo.vllm_mode=server",
            "grpo.vllm_enable_sleep_mode=true",
        ],
        "vllm_mode: server has no effect with generation_backend 'hf'": ["grpo.vllm_mode=server"],
        "vllm_transfer_folder: /shared has no effect with vllm_weight_transfer 'collective'": [
            *server,
            "grpo.vllm_weight_transfer=collective",
            "grpo.vllm_transfer_folder=/shared",
        ],
        "grpo: vllm_mode server without vllm_server_url starts a server on the train task's machine": [
            *server,
            "compute.num_processes=2",
            "compute.num_machines=2",
            "compute.main_process_ip=10.0.0.1",
        ],
    }
    for message, overrides in refused.items():
        with pytest.raises(ValidationError, match=message):
            load_config(None, overrides)
    # an engine per process: colocated rollouts and a sharded evaluation over several
    sharded = load_config(
        None, ["grpo.generation_backend=vllm", "evaluation.generation_backend=vllm", "compute.num_processes=2"]
    )
    assert (sharded.grpo.vllm_mode, sharded.evaluation.generation_backend, sharded.compute.num_processes) == (
        "colocate",
        "vllm",
        2,
    )


def test_grpo_objective_options_that_load():
    grpo = load_config(None).grpo
    assert (grpo.policy_loss, grpo.importance_sampling_level, grpo.delta, grpo.entropy_coef) == (
        "clip",
        "token",
        None,
        0.0,
    )
    assert (grpo.use_bias_correction_kl, grpo.top_entropy_quantile) == (False, 1.0)
    gspo = load_config(None, ["grpo.importance_sampling_level=sequence", "grpo.sequence_epsilon_high=0.001"]).grpo
    assert (gspo.sequence_epsilon, gspo.sequence_epsilon_high) == (3e-4, 1e-3)
    assert load_config(None, ["grpo.policy_loss=cispo", "grpo.cispo_max_ratio=5"]).grpo.cispo_max_ratio == 5.0
    assert load_config(None, ["grpo.importance_sampling_level=sequence", "grpo.delta=1.1"]).grpo.delta == 1.1
    options = ["grpo.beta=0.01", "grpo.use_bias_correction_kl=true", "grpo.top_entropy_quantile=0.2"]
    assert load_config(None, [*options, "grpo.entropy_coef=0.001", "grpo.policy_loss=sapo"]).grpo.entropy_coef == 0.001
    properties = ExperimentConfig.model_json_schema()["$defs"]["GRPOStageConfig"]["properties"]
    assert properties["policy_loss"]["enum"] == ["cispo", "clip", "sapo"]
    assert properties["importance_sampling_level"]["enum"] == ["sequence", "token"]


def test_a_grpo_objective_that_reads_no_section_field_is_a_config_error():
    from trainers.grpo.losses import POLICY_OBJECTIVES, register_policy_objective

    register_policy_objective("plugin_objective", hyperparameters=("plugin_tau",))(lambda *args: None)
    try:
        with pytest.raises(ValidationError, match=r"read \['plugin_tau'\], which are not fields of the section"):
            load_config(None, ["grpo.policy_loss=plugin_objective"])
    finally:
        POLICY_OBJECTIVES.pop("plugin_objective")
    assert load_config(None).grpo.policy_loss == "clip"


def test_promotion_needs_a_model_in_mlflow():
    assert load_config("configs/default.yaml", ["tracking.log_checkpoints=final"]).tracking.log_checkpoints == "final"
    with pytest.raises(ValidationError, match="tracking.log_checkpoints: none stores no model in MLflow"):
        load_config("configs/default.yaml", ["tracking.log_checkpoints=none"])
    assert load_config(None, ["tracking.log_checkpoints=none"]).promotion.registered_model is None


def test_a_chat_template_file_must_lie_in_the_project_or_an_allowed_folder(tmp_path, monkeypatch):
    """A template's text reaches prompts, MLflow's samples and the trained tokenizer: a config may
    name a file of the project (the working folder) or of ALIGNFLOW_TEMPLATE_DIRS, not any file the
    worker can read, and a symlink in the project does not lead out of it."""
    project, shared = tmp_path / "project", tmp_path / "shared"
    (project / "templates").mkdir(parents=True)
    shared.mkdir()
    (project / "templates" / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    (shared / "chat.jinja").write_text("{{ messages[-1]['content'] }}")
    (project / "templates" / "link.jinja").symlink_to(shared / "chat.jinja")
    monkeypatch.chdir(project)
    monkeypatch.delenv("ALIGNFLOW_TEMPLATE_DIRS", raising=False)
    assert load_config(None, ["data.chat_template=templates/chat.jinja"]).data.chat_template == "templates/chat.jinja"
    for outside in (str(shared / "chat.jinja"), "templates/link.jinja", "../shared/chat.jinja"):
        with pytest.raises(ValidationError) as error:
            load_config(None, [f"data.chat_template={outside}"])
        assert config_errors(error.value) == [
            (
                "data.chat_template",
                f"{outside!r} lies outside the folders a template file may come from ({project}): put it in the "
                "project, or list its folder in ALIGNFLOW_TEMPLATE_DIRS",
            )
        ]
    monkeypatch.setenv("ALIGNFLOW_TEMPLATE_DIRS", str(shared))
    assert load_config(None, ["data.chat_template=templates/link.jinja"]).data.chat_template == "templates/link.jinja"


def test_a_chat_template_file_never_comes_from_the_state_folder_or_a_hidden_folder(tmp_path, monkeypatch):
    """The state folder holds the servers' credentials (default `.alignflow/` in the project): none of
    its files, nor any below a hidden file or folder of the project (`.git`, `.env`), is a template,
    even with the state folder listed in ALIGNFLOW_TEMPLATE_DIRS."""
    project = tmp_path / "project"
    (project / ".alignflow" / "servers").mkdir(parents=True)
    (project / ".alignflow" / "servers" / "credentials.json").write_text('{"prefect_auth_string": "secret"}')
    (project / "state").mkdir()
    (project / "state" / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    (project / ".git").mkdir()
    (project / ".git" / "config").write_text("[remote]")
    (project / ".env").write_text("TOKEN=secret")
    monkeypatch.chdir(project)
    for name in ("ALIGNFLOW_HOME", "ALIGNFLOW_TEMPLATE_DIRS", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)

    def error_of(path: str) -> list[tuple[str, str]]:
        with pytest.raises(ValidationError) as error:
            load_config(None, [f"data.chat_template={path}"])
        return config_errors(error.value)

    state = project / ".alignflow"
    assert error_of(".alignflow/servers/credentials.json") == [
        (
            "data.chat_template",
            f"'.alignflow/servers/credentials.json' lies in {state}, a folder of state and credentials: a template "
            "file may not come from it",
        )
    ]
    monkeypatch.setenv("ALIGNFLOW_TEMPLATE_DIRS", str(state))
    listed = str(state / "servers" / "credentials.json")
    assert error_of(listed)[0][1].startswith(f"{listed!r} lies in {state}, a folder of state")
    monkeypatch.delenv("ALIGNFLOW_TEMPLATE_DIRS")
    monkeypatch.setenv("ALIGNFLOW_HOME", "state")  # a state folder that is not hidden
    assert error_of("state/chat.jinja") == [
        (
            "data.chat_template",
            f"'state/chat.jinja' lies in {project / 'state'}, a folder of state and credentials: a template file "
            "may not come from it",
        )
    ]
    for hidden, part in ((".git/config", ".git"), (".env", ".env")):
        assert error_of(hidden) == [
            (
                "data.chat_template",
                f"{hidden!r} lies in a hidden file or folder ({part!r}), where tools keep state and credentials: a "
                "template file may not come from one",
            )
        ]
