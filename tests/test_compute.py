"""The compute section: one device and precision policy for training, the reference pass and the
evaluation; its errors at load and, for what needs the hardware, before the flow starts."""

from __future__ import annotations

import os

import pytest
import torch
from prefect.logging import disable_run_logger
from pydantic import ValidationError

from infra.core.config import (
    ComputeConfig,
    ComputeError,
    ExperimentConfig,
    Hardware,
    ModelConfig,
    check_compute,
    compute_device,
    launcher_temp_folder,
    load_config,
)
from infra.core.handles import ReferenceLogps
from infra.core.refcache import CacheIntegrityError
from infra.ops import cli
from tasks.data import prepare_dataset
from tasks.models import resolve_model
from tasks.reference import compute_columns, reference_dtype, reference_key, reference_key_inputs
from trainers.evaluation.evaluate import preference_rewards
from trainers.models.devices import load_dtype, model_dtype
from trainers.models.pretrained import load_causal_lm
from trainers.scoring.reward_model import REWARD_HEADS, load_reward_model

CPU_ONLY = Hardware(cuda_devices=0, cuda_bf16=False)
OLD_GPU = Hardware(cuda_devices=2, cuda_bf16=False)  # e.g. a V100: no bfloat16
TWO_GPUS = Hardware(cuda_devices=2, cuda_bf16=True)


def config_error(*overrides: str) -> str:
    with pytest.raises(ValidationError) as caught:
        load_config(None, list(overrides))
    return str(caught.value)


@pytest.mark.unit
def test_the_defaults_are_one_process_in_the_checkpoints_dtype():
    compute = ExperimentConfig().compute
    assert (compute.num_processes, compute.num_machines, compute.machine_rank) == (1, 1, 0)
    assert (compute.mixed_precision, compute.dtype, compute.cpu, compute.accelerate_config) == (
        "no",
        "auto",
        False,
        None,
    )
    assert not compute.multi_process
    assert load_config(None, ["compute.mixed_precision=no"]).compute.mixed_precision == "no"  # YAML's bare `no`


@pytest.mark.unit
def test_only_bfloat16_weights_without_autocast_train_in_pure_bf16():
    def pure(*overrides: str) -> bool:
        return load_config(None, list(overrides)).compute.trains_pure_bf16

    assert pure("compute.dtype=bfloat16")  # the train task warns, naming the mixed-precision settings
    assert not pure("compute.dtype=bfloat16", "compute.mixed_precision=bf16")
    assert not pure("compute.dtype=float32", "compute.mixed_precision=bf16") and not pure()


@pytest.mark.unit
def test_bad_compute_settings_are_config_errors_naming_the_field():
    assert "compute.accelerate_config" in (message := config_error("compute.accelerate_config=zero4"))
    assert "'zero4' is neither a shipped config (ddp, fsdp, zero2, zero3) nor an existing file" in message
    assert "machine_rank (2) must be below num_machines (2)" in config_error(
        "compute.num_machines=2",
        "compute.machine_rank=2",
        "compute.main_process_ip=10.0.0.1",
        "compute.num_processes=2",
    )
    assert "num_machines > 1 needs main_process_ip" in config_error("compute.num_machines=2", "compute.num_processes=2")
    assert "num_processes (3) must be a multiple of num_machines (2)" in config_error(
        "compute.num_machines=2", "compute.num_processes=3", "compute.main_process_ip=10.0.0.1"
    )
    assert "compute.mixed_precision" in config_error("compute.mixed_precision=fp8")
    message = config_error("compute.mixed_precision=bf16", "dpo.bf16=true")
    assert "compute.mixed_precision (bf16) applies to every stage; dpo.bf16 sets it again" in message


@pytest.mark.unit
def test_shipped_accelerate_configs_load_with_accelerate():
    from accelerate.commands.config.config_args import load_config_from_file

    from infra.core.config import accelerate_config_path

    kinds = {
        name: load_config_from_file(str(accelerate_config_path(name))) for name in ("ddp", "fsdp", "zero2", "zero3")
    }
    assert {name: c.distributed_type.value for name, c in kinds.items()} == {
        "ddp": "MULTI_GPU",
        "fsdp": "FSDP",
        "zero2": "DEEPSPEED",
        "zero3": "DEEPSPEED",
    }
    assert kinds["fsdp"].fsdp_config["fsdp_version"] == 2
    assert [kinds[name].deepspeed_config["zero_stage"] for name in ("zero2", "zero3")] == [2, 3]


@pytest.mark.unit
@pytest.mark.parametrize(
    "settings, hardware, message",
    [
        ({"num_processes": 2}, CPU_ONLY, "compute.num_processes: 2 processes per machine, but this machine has 0"),
        ({"num_processes": 4}, TWO_GPUS, "compute.num_processes: 4 processes per machine, but this machine has 2"),
        ({"mixed_precision": "fp16"}, CPU_ONLY, "compute.mixed_precision: fp16 needs a CUDA device"),
        ({"mixed_precision": "bf16"}, OLD_GPU, "compute.mixed_precision: this machine's CUDA device does not support"),
        ({"dtype": "bfloat16"}, OLD_GPU, "compute.dtype: this machine's CUDA device does not support bfloat16"),
    ],
)
def test_settings_the_hardware_cannot_run_are_refused(settings, hardware, message):
    with pytest.raises(ComputeError, match=message.replace("(", r"\(")):
        check_compute(ComputeConfig(**settings), hardware)


@pytest.mark.unit
@pytest.mark.parametrize(
    "settings, hardware",
    [
        ({}, CPU_ONLY),
        ({"num_processes": 2, "cpu": True}, CPU_ONLY),  # gloo ranks on the CPU
        ({"mixed_precision": "bf16"}, CPU_ONLY),  # CPU autocast
        ({"mixed_precision": "bf16", "cpu": True}, OLD_GPU),  # the GPU is not used
        ({"num_processes": 4, "num_machines": 2, "main_process_ip": "10.0.0.1"}, TWO_GPUS),  # 2 per machine
    ],
)
def test_settings_the_hardware_can_run_pass(settings, hardware):
    check_compute(ComputeConfig(**settings), hardware)


@pytest.mark.unit
def test_the_flow_runs_on_machine_0_which_launches_every_multi_process_part():
    check_compute(ComputeConfig(num_processes=2, cpu=True), CPU_ONLY)
    two_machines = ComputeConfig(num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1")
    with pytest.raises(ComputeError, match="compute.machine_rank: the flow runs on machine 0"):
        check_compute(two_machines, TWO_GPUS)


@pytest.mark.unit
def test_the_cli_refuses_more_processes_than_devices_before_anything_starts(capsys):
    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has 8 GPUs: 8 processes are fine here")
    with pytest.raises(SystemExit) as stop:
        cli.main(["run", "configs/minimal.yaml", "compute.num_processes=8"])
    assert stop.value.code == 2
    assert (
        "alignflow: invalid config: configs/minimal.yaml: compute.num_processes: 8 processes per machine"
        in capsys.readouterr().err
    )


@pytest.mark.unit
def test_the_loader_takes_the_dtype_and_the_device(tiny_checkpoint):
    model, _ = load_causal_lm(tiny_checkpoint.path, dtype="bfloat16", device="cpu")
    assert model_dtype(model) == "bfloat16" and model.device == torch.device("cpu")
    assert model_dtype(load_causal_lm(tiny_checkpoint.path)[0]) == "float32"  # auto: the checkpoint's
    assert (
        load_dtype(tiny_checkpoint.path) == "float32"
        and load_dtype(tiny_checkpoint.path, None, "bfloat16") == "bfloat16"
    )
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert compute_device(ComputeConfig().cpu).type == expected and compute_device(cpu=True).type == "cpu"


@pytest.mark.unit
def test_loaded_models_run_their_own_layers_not_hub_kernels(tiny_checkpoint):
    """transformers ≥ 5.2x kernelizes a loaded model by default (layers swapped for kernels fetched
    from the Hub at run time, on CUDA); the pipeline's loaders turn that off, for causal LMs and
    reward models alike."""
    assert load_causal_lm(tiny_checkpoint.path)[0].use_kernels is False
    for head in REWARD_HEADS:
        assert load_reward_model(tiny_checkpoint.path, head=head)[0].use_kernels is False, head


@pytest.fixture(scope="module")
def prepared():
    from infra.core.config import AdditionTaskConfig, DataConfig

    base = resolve_model.fn(ModelConfig())
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=4, num_eval_problems=5)), base)
    return base, data


@pytest.mark.unit
def test_the_reference_key_records_the_dtype_the_forward_runs_in(prepared):
    base, data = prepared
    assert reference_dtype(base, ComputeConfig()) == "float32"  # today's key, unchanged on the CPU
    assert reference_key(data, base, reference_dtype(base, ComputeConfig())) == reference_key(data, base)
    bf16 = reference_dtype(base, ComputeConfig(dtype="bfloat16"))
    assert bf16 == "bfloat16" and reference_key(data, base, bf16) != reference_key(data, base)
    assert reference_key_inputs(data, base, bf16)["dtype"] == "bfloat16"

    ref = ReferenceLogps(key="k", root="/unused", data=data, reference=base, batch_size=64, dtype="bfloat16")
    bf16_columns = compute_columns(ref)
    fp32_columns = compute_columns(ref.model_copy(update={"dtype": "float32"}))
    assert bf16_columns.keys() == fp32_columns.keys() == {"preference", "preference_eval"}
    bf16_chosen, fp32_chosen = torch.tensor(bf16_columns["preference"][0]), torch.tensor(fp32_columns["preference"][0])
    assert not torch.equal(bf16_chosen, fp32_chosen)  # the forward really ran in bfloat16
    assert torch.allclose(bf16_chosen, fp32_chosen, rtol=0.05)


@pytest.mark.unit
def test_a_key_that_names_a_label_instead_of_the_models_dtype_is_refused(prepared):
    base, data = prepared
    ref = ReferenceLogps(key="k", root="/unused", data=data, reference=base, batch_size=64, dtype="auto")
    with pytest.raises(CacheIntegrityError, match="loaded in float32, but its cache key says auto"):
        compute_columns(ref)


@pytest.mark.unit
def test_preference_rewards_of_a_bfloat16_model_match_float32(tiny_checkpoint, prepared):
    _, data = prepared
    import datasets

    rows = datasets.load_from_disk(data.path)["preference_eval"].to_list()
    rows = [dict(r, ref_chosen_logps=-5.0, ref_rejected_logps=-6.0) for r in rows]
    fp32 = preference_rewards(*load_causal_lm(tiny_checkpoint.path), rows, beta=0.5)
    bf16 = preference_rewards(*load_causal_lm(tiny_checkpoint.path, dtype="bfloat16"), rows, beta=0.5)
    assert bf16["rewards/accuracies"] == fp32["rewards/accuracies"]
    assert bf16["logratios/margins"] == pytest.approx(fp32["logratios/margins"], rel=0.05, abs=0.05)


@pytest.mark.slow
def test_the_gpu_check_refuses_to_run_without_a_gpu_and_its_cpu_smoke_runs_every_stage(tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: run benchmarks/gpu_check.py itself")
    script = [sys.executable, "benchmarks/gpu_check.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    refused = subprocess.run(script, capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "no CUDA device on this machine; this check needs one GPU" in refused.stderr
    smoke = [
        "--model",
        "builtin:tiny-llama",
        "--steps",
        "2",
        "--allow-cpu",
        "--batch-size",
        "8",
        "--eval-prompts",
        "16",
    ]
    done = subprocess.run(script + smoke, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in done.stdout.splitlines() if line.startswith("| ")]
    stages = ["sft", "reference pass", "dpo", "dpo (lora)", "kto", "reward", "grpo", "distill", "evaluation"]
    assert rows == ["stage", *stages]
    assert "the reference pass and the evaluation ran on cpu" in done.stdout
    assert "GRPO's reward model and the distillation's teacher ran on cpu" in done.stdout
    assert "gpu_check: GRPO on hf: " in done.stdout and " generated tokens/s\n" in done.stdout
    assert list(tmp_path.iterdir()) == []  # its work folder (GBs with the default model) is removed


@pytest.mark.slow
def test_the_chat_shape_check_measures_every_stage_padded_and_padding_free_on_the_same_rows(tmp_path):
    """``gpu_check --shape chat``'s CPU smoke, without TRL (a benchmark's, not the suite's): each stage's two rows
    train on the same real tokens; MFU needs a GPU's peak."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: run benchmarks/gpu_check.py --shape chat itself")
    smoke = ["--shape", "chat", "--allow-cpu", "--model", "builtin:tiny-llama", "--steps", "1"]
    smoke += ["--max-length", "96", "--chat-rows", "3", "--without-trl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", *smoke], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    cells = {(row[0].strip(), row[1].strip()): [cell.strip() for cell in row[2:]] for row in rows}
    stages = ["sft", "dpo-cached", "dpo-live", "reference", "grpo"]
    assert list(cells) == [(stage, framework) for stage in stages for framework in ("alignflow-padded", "alignflow")]
    for stage in stages:
        assert cells[(stage, "alignflow")][0] == cells[(stage, "alignflow-padded")][0] != "0"  # real tokens/step
        assert cells[(stage, "alignflow")][4] == "n/a"  # MFU


@pytest.mark.unit
def test_a_stage_takes_the_compute_sections_dtype_and_mixed_precision(tiny_checkpoint, tmp_path):
    from trainers.catalog import ModelSource, StageInputs
    from trainers.sft.section import SFTConfig
    from trainers.sft.trainer import SFTArguments

    start = ModelSource(tiny_checkpoint.path)

    def stage_inputs(compute: ComputeConfig) -> StageInputs:
        return StageInputs(
            policy=start,
            reference=start,
            splits={},
            output_dir=str(tmp_path),
            dtype=compute.dtype,
            mixed_precision=compute.mixed_precision,
            cpu=compute.cpu,
            padding_free=compute.padding_free,
        )

    inputs = stage_inputs(ComputeConfig(dtype="bfloat16", mixed_precision="bf16"))
    model, _ = inputs.load_policy()
    assert model_dtype(model) == "bfloat16" and model_dtype(inputs.load_reference()) == "bfloat16"
    arguments = SFTConfig().training_arguments(SFTArguments, **inputs.runtime_arguments(model))
    assert arguments.bf16 and not arguments.fp16
    assert arguments.ddp_find_unused_parameters is False  # a dense model: DDP searches for nothing
    assert arguments.use_cpu == (not torch.cuda.is_available())  # bf16 autocast on the CPU
    default = stage_inputs(ComputeConfig())
    assert "bf16" not in default.runtime_arguments(model) and "use_cpu" not in default.runtime_arguments(model)
    on_cpu = stage_inputs(ComputeConfig(cpu=True))
    assert SFTConfig().training_arguments(SFTArguments, **on_cpu.runtime_arguments(model)).use_cpu
    # The compute section is the only place its defaults are declared: inputs without them are refused.
    with pytest.raises(
        TypeError,
        match="missing 4 required positional arguments: 'dtype', 'mixed_precision', 'cpu', and 'padding_free'",
    ):
        StageInputs(policy=start, reference=start, splits={}, output_dir=str(tmp_path))


@pytest.mark.unit
def test_ddp_searches_for_unused_parameters_only_in_a_mixture_of_experts():
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig

    from trainers.models.devices import routes_to_experts

    assert routes_to_experts(MixtralConfig()) and routes_to_experts(Qwen2MoeConfig())
    assert not routes_to_experts(LlamaConfig())
    assert not routes_to_experts(MixtralConfig(num_local_experts=1))  # one expert takes every token


@pytest.mark.unit
def test_a_launch_gets_a_temp_folder_of_its_own(tmp_path):
    """torch's launcher leaves a ``torchelastic_*`` folder in the temp folder of every launch."""
    folder = tmp_path / "launch" / "tmp-0"
    assert launcher_temp_folder(folder) == {"TMPDIR": str(folder)}
    assert folder.is_dir() and list(folder.iterdir()) == []
