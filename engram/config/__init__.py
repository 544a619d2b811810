"""The job configuration: what a run is told, and nothing else.

- `model.py` (`[model]`, `[engram]`, `[lora]`), `training.py` (`[job]`, `[training]`, `[data]`,
  `[optimizer]`, `[lr_scheduler]`, `[checkpoint]`, `[export]`, `[metrics]`, `[profiling]`) and
  `parallelism.py` (`[parallelism]`, `[pipeline]`, `[activation_checkpoint]`, `[float8]`,
  `[compile]`, `[deepspeed]`, `[comm]`): one typed dataclass per TOML section, each field documented and
  checked in `__post_init__`. A new setting goes in its section's class.
- `schema.py`: `JobConfig`, the sections together and the checks that span sections.
- `checks.py`: `ConfigError` and the check helpers.
- `loading.py`: TOML file + `--section.key=value` overrides -> JobConfig (unknown keys and bad
  types are errors), and JobConfig -> TOML.
- `table_optimizers.py`: the registry of Engram table optimizers (name, class, row-sparse or
  not, state bytes per row), read by the config check, the optimizer builder and the planner.
  A new table optimizer's class goes in engram/optim/, its line here.

The names below are the package's public API (`from engram.config import JobConfig`).
"""

from engram.config.checks import ConfigError
from engram.config.loading import config_from_dict, load_config, sections_to_toml, to_toml
from engram.config.model import LORA_TARGETS, MAX_NGRAM, TABLE_LOCATIONS, Engram, Lora, Model
from engram.config.parallelism import (
    FLOAT8_RECIPES,
    PIPELINE_SCHEDULES,
    ActivationCheckpoint,
    Comm,
    Compile,
    DeepSpeed,
    Float8,
    Parallelism,
    Pipeline,
)
from engram.config.schema import JobConfig
from engram.config.training import (
    TRAINING_MODES,
    Checkpoint,
    Data,
    DataSource,
    Export,
    Job,
    LRScheduler,
    Metrics,
    Optimizer,
    Profiling,
    Training,
)

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Data",
    "DataSource",
    "DeepSpeed",
    "Engram",
    "Export",
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
    "TABLE_LOCATIONS",
    "TRAINING_MODES",
    "Training",
    "config_from_dict",
    "load_config",
    "sections_to_toml",
    "to_toml",
]
