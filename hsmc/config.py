"""Typed run configuration: omegaconf structured config from YAML plus `key=value` overrides.

omegaconf checks types and unknown keys against the dataclasses below (its messages name the
full key); `validate` adds the cross-field rules. Every error becomes a `ConfigError` that
names the file and the offending key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

LEVEL_KINDS = ("model",)  # the level-stack issue adds rejection, smc and eagle3
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


@dataclass
class LevelConfig:
    kind: str = "model"
    model: str = MISSING  # hub id | local folder | .gguf path | a demo model's short name
    dtype: str = "float32"
    temperature: float = 0.0


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    ignore_eos: bool = False
    seed: int = 0
    chat_template: bool = True


@dataclass
class EngineConfig:
    device: str = "cpu"
    max_batch_rows: int = 16
    kv_capacity_tokens: int = 4096


@dataclass
class HsmcConfig:
    levels: list[LevelConfig] = field(default_factory=list)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prompts: list[str] = field(default_factory=list)  # used when none are given on the command line


def load_config(source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HsmcConfig:
    """Merge the schema defaults, a YAML file (or mapping) and dotlist overrides, then validate."""
    where = str(source) if isinstance(source, (str, Path)) else "config"
    try:
        if isinstance(source, (str, Path)):
            if not Path(source).is_file():
                raise ConfigError(f"config file not found: {source}")
            data = OmegaConf.load(source)
        else:
            data = OmegaConf.create(source)
        merged = OmegaConf.merge(OmegaConf.structured(HsmcConfig), data)
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            OmegaConf.update(merged, key, yaml.safe_load(value), merge=True)  # `levels.0.x` indexes lists
        cfg: HsmcConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {e}".strip()) from None
    validate(cfg, where)
    return cfg


def validate(cfg: HsmcConfig, where: str = "config") -> None:
    if not cfg.levels:
        raise ConfigError(f"{where}: levels: at least one level is required")
    if len(cfg.levels) > 1:
        raise ConfigError(f"{where}: levels: stacks of several levels are not implemented yet; give one 'model' level")
    for i, level in enumerate(cfg.levels):
        key = f"levels[{i}]"
        if level.kind not in LEVEL_KINDS:
            raise ConfigError(f"{where}: {key}.kind={level.kind!r} is not one of {', '.join(LEVEL_KINDS)}")
        if level.dtype not in DTYPE_NAMES:
            raise ConfigError(f"{where}: {key}.dtype={level.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        if level.temperature < 0:
            raise ConfigError(f"{where}: {key}.temperature must be >= 0, got {level.temperature}")
    for key, value in (
        ("generation.max_new_tokens", cfg.generation.max_new_tokens),
        ("engine.max_batch_rows", cfg.engine.max_batch_rows),
        ("engine.kv_capacity_tokens", cfg.engine.kv_capacity_tokens),
    ):
        if value <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {value}")
