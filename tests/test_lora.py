"""LoRA (``peft:``) on the built-in model: trainable parameters, the adapter-disabled reference,
saving the adapter and a merged copy, and the memory and evaluation knobs of every stage."""

from __future__ import annotations

import re

import pytest
import torch
from prefect.logging import disable_run_logger

from infra.core.config import AdditionTaskConfig, DataConfig, DatasetSource, PeftConfig, load_config
from infra.core.handles import ModelHandle
from infra.core.stage_io import StageFolder, TrainInputs
from tasks.data import prepare_dataset
from tasks.models import check_model_folder, checkpoint_handle, rebased_adapter
from tasks.stage_trainer import stage_inputs
from trainers.catalog import STAGES
from trainers.data.collators import PreferenceCollator, prompt_completion_batch
from trainers.models.builtin import LLAMA_0_5B, TINY_LLAMA
from trainers.models.lora import LoraSettings, add_adapters, live_reference, save_stage_model, trainable_parameters
from trainers.models.pretrained import load_causal_lm
from trainers.scoring.logprobs import completion_logps, next_token_logps
from trainers.sections import checkpointing_argument


@pytest.fixture(scope="module")
def handles(tiny_checkpoint, tmp_path_factory):
    """The tiny model as a checkpoint folder and a real prepared dataset with an SFT eval split."""
    policy = tiny_checkpoint
    sft_eval = tmp_path_factory.mktemp("lora") / "sft_eval.jsonl"
    sft_eval.write_text("".join(f'{{"prompt": "{a}+{a}=", "completion": "{2 * a}"}}\n' for a in range(6)))
    config = DataConfig(
        builtin=AdditionTaskConfig(max_operand=5, num_eval_problems=6), sft_eval=DatasetSource(path=str(sft_eval))
    )
    with disable_run_logger():
        data = prepare_dataset.fn(config, policy)
    return policy, data


def build(stage, overrides, handles, tmp_path, lora=LoraSettings(r=4, alpha=8.0)):  # noqa: B008 (frozen)
    policy, data = handles
    section = load_config(None, overrides).stage(stage)
    inputs = stage_inputs(stage, TrainInputs(policy, data, lora=lora), str(tmp_path), [])
    return STAGES[stage].build(section, inputs)


def randomize_adapters(model, seed=0):
    """Non-zero B matrices (fresh adapters are the identity: B = 0), so the adapters change the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def pair_batch(data, rows=8):
    import datasets

    pairs = datasets.load_from_disk(data.path)["preference"].select(range(rows)).to_list()
    return PreferenceCollator(0)(pairs)


def lora_count(layers, hidden, intermediate, r, kv_hidden=None):
    """Σ over target layers of r·(in + out): q, k, v, o (hidden → hidden, k/v → kv_hidden) and
    gate, up (hidden → intermediate), down (intermediate → hidden), per decoder layer."""
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    attention = 2 * (hidden + hidden) + 2 * (hidden + kv_hidden)
    mlp = 3 * (hidden + intermediate)
    return layers * r * (attention + mlp)


def shape_lora_count(shape: dict, r: int) -> int:
    """:func:`lora_count` of a built-in shape (``trainers.models.builtin``): the k/v projections are
    ``num_key_value_heads`` heads of ``hidden_size / num_attention_heads``."""
    hidden = shape["hidden_size"]
    kv_hidden = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return lora_count(shape["num_hidden_layers"], hidden, shape["intermediate_size"], r, kv_hidden=kv_hidden)


@pytest.mark.slow
@pytest.mark.parametrize(
    "target_modules, expected",
    [
        ("all-linear", lambda r: shape_lora_count(TINY_LLAMA, r)),
        (["q_proj", "v_proj"], lambda r: TINY_LLAMA["num_hidden_layers"] * r * 2 * (2 * TINY_LLAMA["hidden_size"])),
    ],
)
def test_the_trainable_parameters_are_exactly_the_lora_matrices(tiny, target_modules, expected):
    model, _ = tiny
    wrapped = add_adapters(load_copy(model), LoraSettings(r=4, target_modules=target_modules))
    assert trainable_parameters(wrapped) == expected(4)
    assert lora_count(3, 128, 384, 4) == 30720  # by hand: 3 · 4 · (4·256 + 3·512)
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)


def load_copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.slow
def test_the_adapter_disabled_reference_gives_the_base_models_log_probs(tiny, handles):
    model, _ = tiny
    _, data = handles
    batch = pair_batch(data)
    base = completion_logps(model.eval(), batch["input_ids"], batch["attention_mask"], batch["completion_mask"]).logps
    policy = add_adapters(load_copy(model), LoraSettings(r=4, dropout=0.1))
    randomize_adapters(policy)
    policy.train()
    with torch.no_grad():
        adapted = completion_logps(policy.eval(), batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        policy.train()
        with live_reference(None, policy) as reference:
            assert not reference.training  # no LoRA dropout in the reference
            ref = completion_logps(reference, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    assert policy.training  # restored
    assert (adapted.logps - base).abs().max() > 1e-2  # the adapters do change the policy
    assert torch.allclose(ref.logps, base, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_dpo_with_lora_and_a_live_reference_holds_no_second_model_and_its_reference_is_the_base(
    tiny, handles, tmp_path
):
    model, _ = tiny
    trainer = build(
        "dpo", ["dpo.reference=live", "dpo.max_steps=2", "dpo.per_device_train_batch_size=4"], handles, tmp_path
    )
    assert trainer.ref_model is None and trainer.reference_mode == "live"
    trainer.train()
    batch = pair_batch(handles[1])
    ref_chosen, ref_rejected = trainer.reference_logps(batch, 8)
    with torch.no_grad():
        base = completion_logps(model.eval(), batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        policy = completion_logps(trainer.model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    assert torch.allclose(torch.cat([ref_chosen, ref_rejected]), base.logps, atol=1e-6, rtol=0)
    assert (policy.logps - base.logps).abs().max() > 1e-4  # two steps moved the adapters


@pytest.mark.slow
def test_grpo_with_lora_anchors_its_kl_to_the_base_model(tiny, handles, tmp_path):
    model, tokenizer = tiny
    overrides = ["grpo.beta=0.1", "grpo.per_device_train_batch_size=4", "grpo.num_generations=2"]
    trainer = build("grpo", overrides, handles, tmp_path)
    assert trainer.ref_model is None
    randomize_adapters(trainer.model)
    batch = prompt_completion_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], tokenizer.pad_token_id)
    slices = [dict(batch)]
    trainer.add_sampling_logps(trainer.model, slices)
    with torch.no_grad():
        base = next_token_logps(model.eval(), batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    assert torch.allclose(slices[0]["ref_logps"], base.logps, atol=1e-6, rtol=0)


def checkpointing(args) -> bool:
    """Whether the trainer arguments turn activation checkpointing on, under the name this transformers gives it."""
    return getattr(args, checkpointing_argument(type(args)))


@pytest.mark.slow
def test_the_saved_adapter_and_the_merged_copy_give_the_trained_policys_logits(handles, tmp_path):
    overrides = ["dpo.max_steps=2", "dpo.per_device_train_batch_size=4", "dpo.reference=live"]
    overrides.append("dpo.gradient_checkpointing=true")
    trainer = build("dpo", overrides, handles, tmp_path)
    assert checkpointing(trainer.args)
    trainer.train()
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert all(p.abs().max() > 0 for p in lora_b)  # gradients reached every adapter through the checkpointing
    batch = pair_batch(handles[1])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    adapter_dir = save_stage_model(trainer, tmp_path / "model", tmp_path / "adapter")
    assert adapter_dir == tmp_path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter_dir.iterdir()
    }
    check_model_folder(tmp_path / "model")
    check_model_folder(adapter_dir)  # an adapter folder is a model source too (its base is checked)
    for folder in (tmp_path / "model", adapter_dir):  # merged copy; base + adapter loaded from the files
        loaded, _ = load_causal_lm(str(folder))
        with torch.no_grad():
            logits = loaded.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert torch.allclose(logits, expected, atol=1e-5, rtol=0), folder.name
    assert not any("lora" in name for name, _ in load_causal_lm(str(tmp_path / "model"))[0].named_parameters())
    config = adapter_dir / "adapter_config.json"
    config.write_text(config.read_text().replace(str(handles[0].path), str(tmp_path / "gone")))
    with pytest.raises(ValueError, match=f"adapter folder {adapter_dir}: its base model folder .*gone does not exist"):
        check_model_folder(adapter_dir)
    with pytest.raises(ValueError, match="does not exist, and the adapter records no other source of it"):
        rebased_adapter(adapter_dir)  # saved outside a stage: no alignflow_base.json


@pytest.mark.slow
def test_sft_logs_its_eval_loss_on_the_held_out_split_at_eval_steps(tiny, handles, tmp_path):
    import datasets

    overrides = ["sft.max_steps=4", "sft.eval_strategy=steps", "sft.eval_steps=2", "sft.per_device_train_batch_size=8"]
    trainer = build("sft", overrides, handles, tmp_path, lora=None)
    trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4]
    # the last one scored the final model: mean cross-entropy over the held-out completion tokens
    rows = datasets.load_from_disk(handles[1].path)["sft_eval"].to_list()
    batch = prompt_completion_batch([r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], 0)
    with torch.no_grad():
        scores = completion_logps(
            trainer.model.eval(), batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
        )
    expected = -(scores.logps.sum() / scores.num_tokens.sum()).item()
    assert evaluations[-1]["eval_loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_knobs_reach_the_trainer_arguments(handles, tmp_path):
    from trainers.dpo.trainer import DPOConfig

    overrides = ["dpo.eval_strategy=steps", "dpo.eval_steps=3", "dpo.gradient_checkpointing=true"]
    args = build("dpo", overrides, handles, tmp_path, lora=None).args
    assert (args.eval_strategy, args.eval_steps, checkpointing(args)) == ("steps", 3, True)
    assert args.bf16 is False  # bf16: auto on a machine without CUDA
    # report_to passes through (tensorboard is not installed here: the arguments, not a Trainer)
    section = load_config(None, ["dpo.report_to=[tensorboard]", "dpo.bf16=auto"]).dpo
    args = section.training_arguments(DPOConfig, output_dir=str(tmp_path))
    assert args.report_to == ["tensorboard"] and args.bf16 is torch.cuda.is_available()
    assert args.eval_strategy == "no"  # no held-out split given to training_arguments: no evaluation


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dpo.report_to=[mlflow]"], "MLflow is always on"),
        (["grpo.eval_strategy=steps"], "GRPO does not evaluate during training"),
        (
            ["peft.enabled=true", "dpo.reference=live", "dpo.sync_ref_model=true"],
            "dpo.sync_ref_model mixes the policy into a separate reference",
        ),
        (["peft.enabled=true", "stages=[sft]", "peft.stages=[dpo]"], "peft.stages: ['dpo'] not among the stages"),
        (["peft.enabled=true", "peft.target_modules=q_proj"], "peft.target_modules"),
    ],
)
def test_bad_peft_and_knob_settings_are_config_errors(overrides, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.slow
def test_peft_is_off_by_default_and_picks_its_stages():
    assert load_config(None).peft.for_stage("dpo") is None
    chosen = load_config(None, ["peft.enabled=true", "peft.stages=[dpo, grpo]", "peft.r=4"]).peft
    assert chosen.for_stage("sft") is None
    assert chosen.for_stage("dpo") == LoraSettings(r=4)
    assert PeftConfig(enabled=True).for_stage("sft") == LoraSettings()


@pytest.mark.flow
def test_the_default_chain_trains_lora_adapters_in_every_stage_and_evaluates_the_saved_adapter(prefect_api_url):
    """SFT(LoRA) → cached reference → DPO(LoRA) → GRPO(LoRA, KL to its adapter-disabled self): each
    stage starts from the previous stage's merged copy, logs adapter and model, and the adapter
    loads in the evaluation flow with the merged copy's scores."""
    import json
    from pathlib import Path

    from helpers import mlflow_client

    from flows.evaluation import evaluation
    from flows.pipeline import experiment
    from infra.core.config import EvaluationRequest
    from infra.core.settings import get_settings

    overrides = ["name=lora", "peft.enabled=true", "peft.r=4", "grpo.beta=0.1", "sft.seed=23"]
    config = load_config("configs/minimal.yaml", overrides)
    report = experiment(config)
    client = mlflow_client()
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("alignflow").experiment_id], "tags.`mlflow.runName` = 'lora'"
    )
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    runs = {run.info.run_name: run for run in children}
    assert set(runs) == {"sft", "dpo", "grpo", "evaluate"} and set(report.rows) == {"base", "sft", "dpo", "grpo"}
    folders = {}
    for stage in ("sft", "dpo", "grpo"):
        run = runs[stage]
        assert run.data.params["model.trainable_parameters"] == str(shape_lora_count(TINY_LLAMA, 4))
        assert run.data.params["peft.r"] == "4"
        assert {a.path for a in client.list_artifacts(run.info.run_id, "adapter")} >= {
            "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors",
        }
        assert "model/model.safetensors" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}
        folders[stage] = Path(run.data.params["policy.init"])
    # each stage starts from the previous stage's merged copy, whose adapter names it as its base
    dpo_init, grpo_init = folders["dpo"], folders["grpo"]
    assert dpo_init.name == "model" and dpo_init.parent.name.startswith("sft-")  # outputs/<name>/<stage>-<key>
    assert grpo_init.name == "model" and grpo_init.parent.name.startswith("dpo-")
    adapter_config = json.loads((grpo_init.parent / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(dpo_init)
    # the DPO reference cache was computed from the SFT merged copy (the reference: base + SFT adapter merged)
    key = runs["dpo"].data.tags["alignflow.reference_cache_key"]
    manifest = json.loads((Path(get_settings().reference_cache_root) / key / "manifest.json").read_text())
    assert checkpoint_handle(dpo_init, "sft").weights_fingerprint in json.dumps(manifest)

    request = EvaluationRequest(
        name="lora-eval",
        models={
            "merged": str(StageFolder.of_run(config.name, "grpo", runs["grpo"].info.run_id).model_dir),
            "adapter": f"runs:/{runs['grpo'].info.run_id}/adapter",  # downloaded from MLflow
        },
        data=config.data,
        evaluation=config.evaluation.model_dump() | {"suites": [{"task": "builtin:addition"}]},
    )
    # the GRPO adapter's base folder (DPO's merged copy) gone, as on another machine or after `alignflow
    # gc`: it is fetched from the DPO run's model/ artifact, the source recorded beside the adapter
    grpo_adapter = StageFolder.of_run(config.name, "grpo", runs["grpo"].info.run_id).adapter_dir
    source = json.loads((grpo_adapter / "alignflow_base.json").read_text())["source"]
    assert source == f"runs:/{runs['dpo'].info.run_id}/model"
    away = grpo_init.parent.with_name(grpo_init.parent.name + "-away")
    grpo_init.parent.rename(away)
    try:
        scored = evaluation(request)
    finally:
        away.rename(grpo_init.parent)
    merged, adapter = scored.rows["merged"], scored.rows["adapter"]
    assert merged["greedy_accuracy"] == adapter["greedy_accuracy"] == report.rows["grpo"]["greedy_accuracy"]
    # the harness scores the adapter (its base with the adapter's layers in it) as its merged copy
    assert merged["addition/exact_match/none"] == adapter["addition/exact_match/none"] == merged["greedy_accuracy"]


@pytest.mark.slow
def test_a_bare_yaml_no_turns_evaluation_off():
    assert load_config(None, ["dpo.eval_strategy=no"]).dpo.eval_strategy == "no"


@pytest.mark.slow
def test_the_0_5b_example_has_qwen_0_5b_s_parameter_count_and_trains_lora_with_the_memory_knobs():
    """Counted on the meta device (no memory, no init): the shape's parameters by hand, and its
    LoRA parameters; the config turns on LoRA, checkpointing and bf16 (auto) in every stage."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = load_config("configs/llama-0.5b-lora.yaml")
    assert config.model.source == "builtin:llama-0.5b"
    for stage in config.stages:
        assert config.peft.for_stage(stage) == LoraSettings(r=16, alpha=32.0, dropout=0.05)
        assert config.stage(stage).gradient_checkpointing and config.stage(stage).bf16 == "auto"
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_0_5B))
    hidden, mlp, layers, vocab = (
        LLAMA_0_5B[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    kv = hidden // LLAMA_0_5B["num_attention_heads"] * LLAMA_0_5B["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden  # + 2 RMSNorms
    count = sum(p.numel() for p in model.parameters())
    # Qwen2.5-0.5B's 494,032,768 less its q/k/v biases (24 · (896 + 128 + 128) = 27,648), which a Llama has not
    assert count == vocab * hidden + layers * per_layer + hidden == 494_032_768 - 27_648
    wrapped = add_adapters(model, config.peft.for_stage("sft"))
    assert trainable_parameters(wrapped) == shape_lora_count(LLAMA_0_5B, 16) == 8_798_208


@pytest.mark.slow
def test_lora_with_a_live_reference_peaks_below_full_fine_tuning_by_the_reference_gradients_and_moments():
    """Peak RSS of DPO with ``reference: live`` in fresh processes (benchmarks/lora_memory.py, a
    12M Llama): full fine-tuning holds a reference copy, gradients and two AdamW moments (4× the
    weights) that LoRA, whose reference is the policy itself, does not. Allowing 1× for allocator
    noise and LoRA's own state, full must peak at least 3× the weights above LoRA."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "benchmarks/lora_memory.py", "--model=small", "--json", "--steps=1"]
    command += ["--batch-size=2", "--prompt-length=16", "--completion-length=8"]
    output = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout
    measured = json.loads(output.strip().splitlines()[-1])
    full, lora = measured["results"]
    weights_mib = measured["parameters"] * 4 / 2**20
    print(
        f"weights {weights_mib:.0f} MiB; peak RSS full {full['peak_rss_mib']:.0f}, lora {lora['peak_rss_mib']:.0f} MiB"
    )
    assert (full["second_model"], lora["second_model"]) == (True, False)
    assert full["peak_rss_mib"] - lora["peak_rss_mib"] >= 3 * weights_mib


# One step with a gradient on every adapter: no warm-up (its first step has learning rate 0), and
# GRPO's entropy bonus (the random model's equal rewards give zero advantages).
STAGE_STEPS = {
    "sft": ["sft.max_steps=1", "sft.per_device_train_batch_size=8", "sft.warmup_ratio=0"],
    "dpo": ["dpo.max_steps=1", "dpo.per_device_train_batch_size=4", "dpo.reference=live"],
    "grpo": [
        "grpo.max_steps=1",
        "grpo.per_device_train_batch_size=4",
        "grpo.num_generations=2",
        "grpo.beta=0.1",
        "grpo.entropy_coef=0.1",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGE_STEPS))
def test_every_stage_trains_its_adapters_with_gradient_checkpointing_and_bf16(stage, handles, tmp_path):
    """One step with LoRA, checkpointing and bf16 autocast (on CPU here): every B matrix, zero at
    the start, has moved, and nothing but the adapters has."""
    knobs = [f"{stage}.gradient_checkpointing=true", f"{stage}.bf16=true", f"{stage}.learning_rate=0.01"]
    trainer = build(stage, STAGE_STEPS[stage] + knobs, handles, tmp_path)
    assert checkpointing(trainer.args) and trainer.args.bf16
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 1
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 3 * 7 and all(p.abs().max() > 0 for p in lora_b)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)


@pytest.mark.unit
def test_an_adapters_recorded_base_is_typed_and_a_tampered_one_is_refused_naming_the_file(tmp_path):
    from tasks.models import AdapterBase, record_adapter_base

    base = ModelHandle(
        path=str(tmp_path),
        fingerprint="f",
        tokenizer_fingerprint="t",
        stage="dpo",
        source="runs:/abc/model",
        revision="r1",
    )
    record_adapter_base(tmp_path, base)
    assert AdapterBase.read(tmp_path) == AdapterBase(source="runs:/abc/model", revision="r1")
    assert AdapterBase.read(tmp_path / "elsewhere") == AdapterBase(source=None)
    (tmp_path / "alignflow_base.json").write_text('{"source": "runs:/abc/model", "path": "/etc"}')
    refused = r"alignflow_base.json: not an adapter's recorded base: (?s:.*)path\n  Extra inputs"
    with pytest.raises(ValueError, match=refused):
        AdapterBase.read(tmp_path)
