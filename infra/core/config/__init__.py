"""The experiment config: one typed schema (pydantic) that is the flow's parameter and the source
of every stage's trainer arguments. The package's modules split its jobs: the sections and the
experiment (``schema``), the compute section, its hardware checks and launch command
(``compute``), reading YAML and overrides (``loading``), error text (``errors``) and dotted keys
of nested dicts (``tree``); callers import from here."""

from infra.core.config.compute import (
    ACCELERATE_CONFIG_DIR,
    ComputeConfig,
    ComputeError,
    Hardware,
    accelerate_config_path,
    check_compute,
    compute_device,
    launcher_temp_folder,
)
from infra.core.config.errors import config_errors, did_you_mean
from infra.core.config.loading import load_config, merge_onto, read_yaml
from infra.core.config.schema import (
    BUILTIN_MODEL_NAMES,
    SCHEMAS,
    AdditionTaskConfig,
    DataConfig,
    DatasetSource,
    EvaluationConfig,
    EvaluationRequest,
    ExperimentConfig,
    ModelConfig,
    PeftConfig,
    PromotionConfig,
    ReferenceConfig,
    SafeName,
    TrackingConfig,
    is_template_text,
    seeded_fields,
    template_file,
)
from infra.core.config.tree import set_path

__all__ = [
    "ACCELERATE_CONFIG_DIR",
    "BUILTIN_MODEL_NAMES",
    "SCHEMAS",
    "AdditionTaskConfig",
    "ComputeConfig",
    "ComputeError",
    "DataConfig",
    "DatasetSource",
    "EvaluationConfig",
    "EvaluationRequest",
    "ExperimentConfig",
    "Hardware",
    "ModelConfig",
    "PeftConfig",
    "PromotionConfig",
    "ReferenceConfig",
    "SafeName",
    "is_template_text",
    "template_file",
    "TrackingConfig",
    "accelerate_config_path",
    "check_compute",
    "compute_device",
    "launcher_temp_folder",
    "config_errors",
    "did_you_mean",
    "load_config",
    "merge_onto",
    "read_yaml",
    "seeded_fields",
    "set_path",
]
