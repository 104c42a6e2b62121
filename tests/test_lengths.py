"""``data.max_length`` / ``max_prompt_length: auto`` and the cut-share gate (issue 25, finding 2):
lengths read off ChatML data with a character-level tokenizer, whose token counts are the
characters of the render plus one per special token, so every expected length is counted here."""

import json
import re
from pathlib import Path

import datasets
import pytest
from prefect.logging import disable_run_logger
from transformers import LlamaConfig

from infra.core.config import DataConfig, DatasetSource, ExperimentConfig
from infra.core.handles import ModelHandle
from infra.core.settings import get_settings
from tasks.data import check_generations, prepare_dataset
from tests.helpers import chat_tokenizer, model_with_context
from trainers.data.clipping import MARGIN_TOKENS, TextClip
from trainers.data.lengths import (
    config_context,
    fitting_length,
    model_context,
    prompt_lengths,
    resolve_truncation,
)
from trainers.data.rows import DataValidationError, RenderedRow, Truncation, render_rows, truncate_rows
from trainers.evaluation.evaluate import GenerationSpec, score_prompts
from trainers.generation.budget import Generation

pytestmark = pytest.mark.unit

SYSTEM = "Be brief."
# <|im_start|>system\n SYSTEM <|im_end|>\n <|im_start|>user\n USER <|im_end|>\n <|im_start|>assistant\n
PROMPT_OVERHEAD = (1 + len("system\n") + 1 + 1) + (1 + len("user\n") + 1 + 1) + (1 + len("assistant\n"))


def chat_rows(count: int, outlier: int) -> list[dict]:
    """SFT rows whose user turn has 1..50 characters in turn, the last one ``outlier`` characters;
    each answer is "ok" (2 characters + <|im_end|>)."""
    users = [1 + i % 50 for i in range(count - 1)] + [outlier]
    return [
        {
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x" * n}],
            "completion": [{"role": "assistant", "content": "ok"}],
        }
        for n in users
    ]


def row(prompt: int, *completions: int) -> RenderedRow:
    return RenderedRow([0] * prompt, {f"c{i}": [0] * n for i, n in enumerate(completions)}, None, True)


def test_fitting_length_is_the_nearest_rank_quantile_rounded_up_to_a_multiple_of_8():
    lengths = list(range(1, 201))  # rank ceil(0.995 * 200) = 199: length 199, rounded up to 200
    assert fitting_length(lengths) == 200
    assert fitting_length([9] * 199 + [10_000]) == 16  # one outlier in 200 is left out
    assert fitting_length([9] * 198 + [10_000] * 2) == 10_000  # two are not: 0.5% is at most one row
    assert (fitting_length([1]), fitting_length([])) == (8, 0)


def test_auto_lengths_fit_every_split_and_respect_fixed_values_and_the_context():
    splits = {"sft": [row(10, 5)] * 10 + [row(30, 5)] * 190, "grpo_prompts": [row(41)] * 5}
    # prompt: the larger split quantile (41 -> 48); total: min(prompt, 48) + 5 = 35 -> 40, at least 49
    assert resolve_truncation(splits, "auto", "auto", "keep_end", None).max_prompt_length == 48
    assert resolve_truncation(splits, "auto", "auto", "keep_end", None).max_length == 49
    long = {"sft": [row(10, 100)] * 200}  # total 110 -> 112
    assert (resolve_truncation(long, "auto", "auto", "keep_end", None).max_length) == 112
    assert resolve_truncation(long, "auto", "auto", "keep_end", 64).max_length == 64  # capped by the context
    assert resolve_truncation(long, 12, "auto", "keep_end", None).max_prompt_length == 11  # below a fixed total
    fixed = resolve_truncation(long, "auto", 4, "drop", None)  # total from the prompt as cut: 4 + 100 -> 104
    assert (fixed.max_length, fixed.max_prompt_length, fixed.mode) == (104, 4, "drop")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> ModelHandle:
    """A folder with a ChatML character tokenizer and a model config of 512 positions."""
    folder = tmp_path_factory.mktemp("chatml-model")
    tokenizer = chat_tokenizer("chatml")
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
    config.max_position_embeddings = 512
    config.save_pretrained(folder)
    return ModelHandle(path=str(folder), fingerprint="chatml", tokenizer_fingerprint="chatml", stage="base")


@pytest.fixture
def chat_data(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(200, outlier=400)))
    return path


def data_config(path: Path, **fields) -> DataConfig:
    return DataConfig(builtin=None, sft=DatasetSource(path=str(path)), **fields)


def manifest_of(prepared) -> dict:
    return json.loads((Path(prepared.path).parent / "manifest.json").read_text())


def test_auto_lengths_on_chat_data_cut_at_most_one_percent_and_are_recorded(chat_model, chat_data):
    with disable_run_logger():
        prepared = prepare_dataset.fn(data_config(chat_data), chat_model)
    # prompts: 38 + 1..50 characters, one of 438; the 199th of 200 is 88 (a multiple of 8)
    assert PROMPT_OVERHEAD + len(SYSTEM) == 38
    # totals: min(prompt, 88) + 3 <= 91 for all 200 rows -> 96
    assert prepared.truncation == {"max_length": 96, "max_prompt_length": 88, "mode": "keep_end"}
    manifest = manifest_of(prepared)
    assert (manifest["rows_read"], manifest["cut"], manifest["truncated_prompts"]) == (
        {"sft": 200},
        {"sft": 1},  # the outlier alone: 0.5%
        {"sft": 1},
    )
    assert manifest["fitted_lengths"] == {"max_length": 96, "max_prompt_length": 88} and manifest["context"] == 512


def test_fixed_lengths_that_cut_most_rows_fail_preparation_with_the_counts_and_the_fix(chat_model, chat_data):
    config = data_config(chat_data, max_length=32, max_prompt_length=16)
    with disable_run_logger(), pytest.raises(DataValidationError) as error:
        prepare_dataset.fn(config, chat_model)
    assert str(error.value) == (
        "data: truncation at max_length=32, max_prompt_length=16 cuts more than data.max_cut_share=0.05 of the "
        "rows: sft: 200 of 200 rows (200 prompts cut, 0 completions cut, 0 dropped). Set data.max_length=auto "
        "data.max_prompt_length=auto (here 96 and 88: they fit 99.5% of every split), or set "
        "data.max_cut_share=1 to train on the cut rows"
    )
    with disable_run_logger():
        accepted = prepare_dataset.fn(config.model_copy(update={"max_cut_share": 1.0}), chat_model)
    assert accepted.truncated_prompts == {"sft": 200}
    # the share is not part of the cache key: the cached preparation is judged again, and refused
    with disable_run_logger(), pytest.raises(DataValidationError, match="sft: 200 of 200 rows"):
        prepare_dataset.fn(config, chat_model)


@pytest.fixture
def small_context_model(chat_model, tmp_path) -> ModelHandle:
    """The chat model, copied with a context of 64 positions."""
    small = model_with_context(chat_model.path, tmp_path / "small-context", 64)
    return chat_model.model_copy(update={"path": str(small)})


def test_the_context_caps_auto_lengths_and_the_gate_still_applies(small_context_model, chat_data):
    handle = small_context_model
    # prompts over 63 tokens (users of 26..50 characters: 99 rows, and the outlier) are cut and leave one
    # token of their 3-token completion; users of 24 and 25 characters (8 rows) keep their prompt and 2 or 1
    with disable_run_logger(), pytest.raises(DataValidationError) as error:
        prepare_dataset.fn(data_config(chat_data), handle)
    assert "max_length=64, max_prompt_length=63 " in str(error.value)
    assert "sft: 108 of 200 rows (100 prompts cut, 108 completions cut, 0 dropped)" in str(error.value)


def test_a_fixed_max_length_beyond_the_models_context_fails_preparation_and_writes_nothing(
    small_context_model, chat_data
):
    config = data_config(chat_data, max_length=65, max_prompt_length=16, max_cut_share=1.0)
    with disable_run_logger(), pytest.raises(DataValidationError) as error:
        prepare_dataset.fn(config, small_context_model)
    assert str(error.value) == (
        f"data.max_length=65 is longer than the model's context: {small_context_model.path} takes at most 64 "
        "positions (its config.json). Set data.max_length to at most 64, or to auto"
    )
    assert list(get_settings().data_cache.glob("*")) == []  # no entry, not even a partial one
    with disable_run_logger():  # the context itself is allowed
        prepared = prepare_dataset.fn(config.model_copy(update={"max_length": 64}), small_context_model)
    assert prepared.truncation == {"max_length": 64, "max_prompt_length": 16, "mode": "keep_end"}


def test_the_builtin_configs_keep_their_short_lengths_and_the_default_is_auto():
    from infra.core.config import load_config

    for name in ("default", "minimal", "llama-0.5b-lora"):
        data = load_config(f"configs/{name}.yaml", []).data
        assert (data.max_length, data.max_prompt_length) == (32, 16)
    assert (ExperimentConfig().data.max_length, ExperimentConfig().data.max_prompt_length) == ("auto", "auto")


def test_the_context_is_read_from_the_models_config_as_json(tmp_path):
    from trainers.data.lengths import context_length

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    (tmp_path / "tokenizer-only").mkdir()
    assert context_length(str(tmp_path / "gpt2")) == 1024
    assert context_length(str(tmp_path / "tokenizer-only")) is None
    assert context_length(str(tmp_path / "missing")) is None  # an absolute path is never a hub id


@pytest.mark.parametrize("mode", ["keep_end", "keep_start", "drop"])
def test_texts_clipped_before_tokenizing_give_the_rows_and_counts_of_whole_ones(mode):
    """What truncation keeps of a clipped text is what it keeps of the whole one, token for token,
    and a clipped row counts as cut as before; the texts the tokenizer sees are at most the clip."""
    tokenizer = chat_tokenizer("chatml")
    long_words = " ".join(f"w{i}" for i in range(30_000))  # 180k characters
    rows = [
        {"prompt": [{"role": "user", "content": f"start {long_words} end"}], "completion": "4"},
        {"prompt": "2+2=", "completion": f"4 {long_words}"},
        {"prompt": "1+1=", "completion": "2"},
    ]
    truncation = Truncation(64, 32, mode)
    clip = TextClip.for_tokenizer(tokenizer, truncation.max_length, keep_end=mode == "keep_end")
    assert clip.max_chars == (64 + MARGIN_TOKENS) * max(map(len, tokenizer.get_vocab())) < 20_000

    whole = truncate_rows(render_rows(rows, "sft", tokenizer), truncation)
    clipped_rows = render_rows(rows, "sft", tokenizer, clip=clip)
    assert max(len(r.prompt_ids) + r.longest for r in clipped_rows) <= clip.max_chars + 8  # one token a character
    assert truncate_rows(clipped_rows, truncation) == whole
    assert whole.cut == 2


def test_a_generation_fits_when_its_longest_prompt_as_cut_plus_its_completions_fit_the_context():
    Generation(34, "grpo.max_completion_length").check([10, 30], 64)  # the last token at the last position
    Generation(44, "grpo.max_completion_length", max_prompt_length=20).check([10, 30], 64)  # prompts cut to 20 first
    Generation(6, "grpo.max_completion_length").check([500], None)  # no context known: nothing to check
    with pytest.raises(ValueError) as error:
        Generation(35, "distill.max_new_tokens").check([10, 30], 64)
    assert str(error.value) == (
        "distill: the longest prompt (30 tokens) + distill.max_new_tokens (35) is 65 tokens, beyond the model's "
        "context (64 positions): set distill.max_new_tokens to at most 34, or cut the prompts shorter "
        "(data.max_prompt_length)"
    )
    # an engine's own length is the limit where it is shorter than the context, or the context is unknown
    engine = Generation(20, "grpo.max_completion_length", engine_length=48, engine_setting="grpo.vllm_max_model_len")
    engine.check([28], 64)
    engine.check([10], None)
    Generation(50, "grpo.max_completion_length", engine_length=96).check([14], 64)  # the context is the shorter
    with pytest.raises(ValueError, match=r"beyond grpo.vllm_max_model_len \(48 positions\): set grpo.max_"):
        engine.check([29], 64)
    with pytest.raises(ValueError, match=r"beyond the model's context \(64 positions\)"):
        Generation(51, "grpo.max_completion_length", engine_length=96).check([14], 64)
    rows = [{"prompt_ids": [1] * n} for n in (3, 7, 5)]
    assert prompt_lengths(datasets.Dataset.from_list(rows)) == prompt_lengths(rows) == [3, 7, 5]
    assert prompt_lengths(None) == []
    assert config_context({"n_positions": 1024, "hidden_size": 8}) == 1024
    assert config_context({"max_position_embeddings": None, "seq_length": 77}) == 77
    assert config_context({"hidden_size": 8}) is None
    # rotary scaling: YaRN stretches its original length, linear / dynamic the stated one, by the factor
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert config_context({"max_position_embeddings": 32768, "rope_scaling": yarn}) == 131072  # Qwen2.5 with YaRN
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert config_context({"max_position_embeddings": 4096, "rope_parameters": linear}) == 8192  # transformers 5
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert config_context({"max_position_embeddings": 131072, "rope_scaling": llama3}) == 131072  # stated scaled
    assert config_context({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default"}}) == 2048


def test_an_evaluation_whose_completions_would_pass_the_models_context_is_refused_before_generating(tiny):
    model, tokenizer = tiny
    row = {"prompt_ids": tokenizer("12+34=")["input_ids"], "answer": "46"}
    assert (len(row["prompt_ids"]), model_context(model)) == (6, 128)
    with pytest.raises(ValueError) as error:
        score_prompts(model, tokenizer, [row], GenerationSpec(max_new_tokens=123, num_samples=1))
    assert str(error.value) == (
        "evaluation: the longest prompt (6 tokens) + evaluation.max_new_tokens (123) is 129 tokens, beyond the "
        "model's context (128 positions): set evaluation.max_new_tokens to at most 122, or cut the prompts shorter "
        "(data.max_prompt_length)"
    )


TEACHER = {"teacher_model": "builtin:tiny-llama"}


@pytest.mark.parametrize(
    ("stages", "overrides", "refused"),
    [
        (["sft", "grpo"], {"grpo": {"max_completion_length": 125}}, "grpo.max_completion_length (125) is 129"),
        (
            ["sft", "distill"],
            {"distill": TEACHER},
            "distill.max_new_tokens (128) is 132",
        ),
        (["sft", "dpo"], {"evaluation": {"max_new_tokens": 125}}, "evaluation.max_new_tokens (125) is 129"),
        (["sft", "distill"], {"distill": TEACHER | {"lmbda": 0.0}}, None),  # supervised KD: nothing sampled
        (["grpo"], {"grpo": {"max_completion_length": 124}, "evaluation": {"max_new_tokens": 124}}, None),
    ],
    ids=["grpo", "distill", "evaluation", "supervised-distill", "fitting"],
)
def test_the_flow_refuses_a_generation_past_the_context_once_the_data_is_prepared(handles, stages, overrides, refused):
    """The prepared built-in prompts are 4 tokens (``handles``' data; the evaluation's are the
    ``eval_prompts`` it scores), the tiny model's context 128 positions: GRPO's, on-policy
    distillation's and the evaluation's completions are checked before any stage trains."""
    policy, data, _ = handles
    assert (
        max(prompt_lengths(datasets.load_from_disk(data.path)["grpo_prompts"])),
        config_context(json.loads((Path(policy.path) / "config.json").read_text())),
        data.context,
    ) == (4, 128, 128)
    config = ExperimentConfig(stages=stages, **overrides)
    if refused is None:
        check_generations(config, data)
        return
    with pytest.raises(ValueError, match=r"^\w+: the longest prompt \(4 tokens\) \+ " + re.escape(refused)):
        check_generations(config, data)
