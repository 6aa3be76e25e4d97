"""The one schema of a run: RunConfig, its option groups and its nodes."""

from regen.config.fields import ConfigError, FlatField
from regen.config.nodes import NodeSpec
from regen.config.run import RunConfig, read_config_file, run_fields

__all__ = ["ConfigError", "FlatField", "NodeSpec", "RunConfig", "read_config_file", "run_fields"]
