"""Config values that cannot work are refused when the config loads (issue 26): infinities and NaN
in any float field, keys given twice, YAML that expands or nests without bound, names MLflow or the
file system would refuse later, seeds the RNGs refuse, and plugin entries that are not module names."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, ValidationError

from infra.core.config import DatasetSource, EvaluationRequest, ExperimentConfig, config_errors, load_config
from infra.core.sweep import Range

pytestmark = pytest.mark.unit

NON_FINITE = (".inf", "-.inf", ".nan")


def float_keys(annotation, key: str) -> Iterator[tuple[str, bool]]:
    """``(dotted key, is a list)`` of every float reachable from ``annotation``; sections reached
    through a union with other types (dataset sources) are left to their own test."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is float:
        yield key, False
    elif origin is typing.Annotated:
        yield from float_keys(args[0], key)
    elif origin in (typing.Union, types.UnionType):
        for arg in args:
            if not (isinstance(arg, type) and issubclass(arg, BaseModel)) or len(args) == 2 and type(None) in args:
                yield from float_keys(arg, key)
    elif origin is list and args and float in (args[0], *typing.get_args(args[0])):
        yield key, True
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            yield from float_keys(field.annotation, f"{key}.{name}" if key else name)


EXPERIMENT_FLOATS = sorted(set(float_keys(ExperimentConfig, "")))


def test_the_walk_finds_the_float_fields_of_every_section():
    keys = {key for key, _ in EXPERIMENT_FLOATS}
    assert {
        "dpo.beta",
        "sft.learning_rate",
        "sft.num_train_epochs",
        "sft.weight_decay",
        "evaluation.temperature",
    } <= keys
    assert {"grpo.reward_weights", "promotion.min_improvement", "promotion.min_value", "data.max_cut_share"} <= keys
    assert len(keys) > 40


@pytest.mark.parametrize("key, is_list", EXPERIMENT_FLOATS, ids=[key for key, _ in EXPERIMENT_FLOATS])
def test_every_float_field_refuses_infinities_and_nan(key, is_list):
    for value in NON_FINITE:
        with pytest.raises(ValidationError) as error:
            load_config(None, [f"{key}=[{value}]" if is_list else f"{key}={value}"])
        problems = dict(config_errors(error.value))
        where = f"{key}.0" if is_list else key
        assert "finite number" in problems.get(where, ""), (value, problems)


def test_float_fields_outside_the_experiment_refuse_them_too():
    with pytest.raises(ValidationError, match="finite number"):
        DatasetSource(path="a.jsonl", weight=float("inf"))
    with pytest.raises(ValidationError, match="finite number"):
        Range(low=0.0, high=float("nan"))
    with pytest.raises(ValidationError, match="finite number"):
        EvaluationRequest(models={"a": "builtin:tiny-llama"}, beta=float("inf"))


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("seed=-1", "seed", "greater than or equal to 0"),
        ("dpo.seed=4294967296", "dpo.seed", "less than or equal to 4294967295"),
        ("name=" + "n" * 101, "name", "a name of 101 characters: at most 100"),
        ("promotion.alias=latest", "promotion.alias", "'latest' is reserved by MLflow"),
        ("promotion.alias=v3", "promotion.alias", "'v3' is reserved by MLflow"),
        ("promotion.registered_model=team/model", "promotion.registered_model", "should match pattern"),
    ],
)
def test_values_a_later_step_would_refuse_are_refused_at_load(override, key, message):
    with pytest.raises(ValidationError) as error:
        load_config(None, [override])
    assert message in dict(config_errors(error.value))[key]


@pytest.mark.parametrize(
    "seed, message",
    [
        ("-1", "Input should be greater than or equal to 0"),
        ("4294967296", "Input should be less than or equal to 4294967295"),
        ("abc", "Input should be a valid integer, unable to parse string as an integer"),
    ],
)
def test_a_bad_top_level_seed_is_reported_once_at_the_field_the_user_wrote(seed, message):
    """`seed` sets model.seed, each stage's seed and evaluation.seed: a value none of them takes is
    one error at `seed`, not one per field it would have set."""
    with pytest.raises(ValidationError) as error:
        load_config(None, [f"seed={seed}"])
    assert config_errors(error.value) == [("seed", message)]


@pytest.mark.parametrize("entry", [".relative", "", "my module", 3])
def test_a_plugin_entry_that_is_not_a_module_name_is_refused_naming_it(entry):
    with pytest.raises(ValidationError) as error:
        ExperimentConfig.model_validate({"plugins": [entry]})
    assert f"plugins: {entry!r} is not a module name" in str(error.value)


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_by_name(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from trainers.models.pretrained import load_tokenizer

    backend = Tokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"the tokenizer of {tmp_path} has neither a pad token nor an EOS token"):
        load_tokenizer(str(tmp_path))
