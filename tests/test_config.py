import pytest
from pydantic import ValidationError

from infra.config import ExperimentConfig, load_config


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
    assert schema["$defs"]["DPOStageConfig"]["properties"]["reference"]["enum"] == ["cached", "live"]
    assert "description" in schema["$defs"]["DPOStageConfig"]["properties"]["beta"]
