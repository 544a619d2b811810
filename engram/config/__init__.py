"""The job configuration: what a run is told, and nothing else.

- `schema.py`: one typed dataclass per TOML section (`[job]`, `[model]`, `[engram]`, ...), each
  field documented and checked in `__post_init__`. A new setting goes here.
- `loading.py`: TOML file + `--section.key=value` overrides -> JobConfig (unknown keys and bad
  types are errors), and JobConfig -> TOML.
- `table_optimizers.py`: the registry of Engram table optimizers (name, class, row-sparse or
  not, state bytes per row), read by the config check, the optimizer builder and the planner.
  A new table optimizer's class goes in engram/optim/, its line here.

The names below are the package's public API (`from engram.config import JobConfig`).
"""

from engram.config.loading import config_from_dict, load_config, sections_to_toml, to_toml
from engram.config.schema import (
    FLOAT8_RECIPES,
    LORA_TARGETS,
    MAX_NGRAM,
    PIPELINE_SCHEDULES,
    ROW_SPARSE_TABLE_OPTIMIZERS,
    TABLE_LOCATIONS,
    TRAINING_MODES,
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    ConfigError,
    Data,
    DataSource,
    DeepSpeed,
    Engram,
    Float8,
    Job,
    JobConfig,
    Lora,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Pipeline,
    Profiling,
    Training,
)

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "ConfigError",
    "Data",
    "DataSource",
    "DeepSpeed",
    "Engram",
    "FLOAT8_RECIPES",
    "Float8",
    "Job",
    "JobConfig",
    "LORA_TARGETS",
    "LRScheduler",
    "Lora",
    "MAX_NGRAM",
    "Metrics",
    "Model",
    "Optimizer",
    "PIPELINE_SCHEDULES",
    "Parallelism",
    "Pipeline",
    "Profiling",
    "ROW_SPARSE_TABLE_OPTIMIZERS",
    "TABLE_LOCATIONS",
    "TRAINING_MODES",
    "Training",
    "config_from_dict",
    "load_config",
    "sections_to_toml",
    "to_toml",
]
