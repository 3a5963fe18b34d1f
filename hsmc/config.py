"""Typed run configuration: omegaconf structured config from YAML plus `key=value` overrides.

omegaconf checks types and unknown keys against the dataclasses below (its messages name the
full key); `validate` adds the cross-field rules. Every error becomes a `ConfigError` that
names the file and the offending key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hsmc.errors import ConfigError

T = TypeVar("T")
LEVEL_KINDS = ("model", "eagle3", "rejection", "smc")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")


@dataclass
class LevelConfig:
    kind: str = "model"  # model | eagle3 | rejection | smc, listed bottom (cheapest) to top
    model: str = MISSING  # hub id | local folder | .gguf path | demo short name (eagle3: the head's folder/id)
    dtype: str = "float32"
    temperature: float = 0.0
    num_layers: int | None = None  # keep only the first n decoder layers (a cheap self-draft)
    num_draft_tokens: int = 4  # rejection: γ drafts verified per cycle
    particles: int = 4  # smc: N
    block_size: int = 4  # smc: K proposal tokens per cycle (0 = target-only sampling)
    alpha: float = 1.0  # smc: target is p_T^alpha
    ess_threshold: float = 0.5  # smc: resample when ESS < τ·N (0 disables)
    resampling: str = "systematic"  # smc: systematic | multinomial
    selection: str = "sample"  # smc: sample | argmax


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends when the text contains one
    ignore_eos: bool = False
    seed: int = 0
    chat_template: bool = True


@dataclass
class EngineConfig:
    device: str = "cpu"
    max_batch_rows: int = 16
    kv_capacity_tokens: int = 4096
    attention: str | None = None  # kernel backend: torch | triton; default triton on cuda, torch elsewhere
    cuda_graphs: bool | None = None  # replay captured CUDA graphs for decode/verify forwards; default: on cuda

    @property
    def resolved_attention(self) -> str:
        return self.attention or ("triton" if self.device.startswith("cuda") else "torch")

    @property
    def resolved_cuda_graphs(self) -> bool:
        return self.device.startswith("cuda") if self.cuda_graphs is None else self.cuda_graphs


@dataclass
class HsmcConfig:
    levels: list[LevelConfig] = field(default_factory=list)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prompts: list[str] = field(default_factory=list)  # used when none are given on the command line


def load_config(source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HsmcConfig:
    """Merge the schema defaults, a YAML file (or mapping) and dotlist overrides, then validate."""
    cfg = load_structured(HsmcConfig, source, overrides)
    validate(cfg, str(source) if isinstance(source, (str, Path)) else "config")
    return cfg


def load_structured(schema: type[T], source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> T:
    """An instance of the dataclass `schema` from YAML (or a mapping) plus `key=value` overrides."""
    where = str(source) if isinstance(source, (str, Path)) else "config"
    try:
        if isinstance(source, (str, Path)):
            if not Path(source).is_file():
                raise ConfigError(f"config file not found: {source}")
            data = OmegaConf.load(source)
        else:
            data = OmegaConf.create(source)
        merged = OmegaConf.merge(OmegaConf.structured(schema), data)
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            OmegaConf.update(merged, key, yaml.safe_load(value), merge=True)  # `levels.0.x` indexes lists
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {e}".strip()) from None


def validate(cfg: HsmcConfig, where: str = "config") -> None:
    if not cfg.levels:
        raise ConfigError(f"{where}: levels: at least one level is required")
    for i, level in enumerate(cfg.levels):
        key = f"{where}: levels[{i}]"
        if level.kind not in LEVEL_KINDS:
            raise ConfigError(f"{key}.kind={level.kind!r} is not one of {', '.join(LEVEL_KINDS)}")
        if level.dtype not in DTYPE_NAMES:
            raise ConfigError(f"{key}.dtype={level.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        if level.temperature < 0:
            raise ConfigError(f"{key}.temperature must be >= 0, got {level.temperature}")
        if level.num_layers is not None and level.num_layers <= 0:
            raise ConfigError(f"{key}.num_layers must be positive, got {level.num_layers}")
        if level.kind == "rejection" and level.num_draft_tokens <= 0:
            raise ConfigError(f"{key}.num_draft_tokens must be positive, got {level.num_draft_tokens}")
        _validate_position(cfg.levels, i, key)
        if level.kind == "smc":
            _validate_smc(level, cfg.levels[i - 1], key)
    engine = cfg.engine
    if engine.attention not in (None, *ATTENTION_BACKENDS):
        raise ConfigError(
            f"{where}: engine.attention={engine.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if engine.resolved_cuda_graphs and not engine.device.startswith("cuda"):
        raise ConfigError(f"{where}: engine.cuda_graphs=true needs engine.device=cuda, not {engine.device!r}")
    for key, value in (
        ("generation.max_new_tokens", cfg.generation.max_new_tokens),
        ("engine.max_batch_rows", cfg.engine.max_batch_rows),
        ("engine.kv_capacity_tokens", cfg.engine.kv_capacity_tokens),
    ):
        if value <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {value}")


def _validate_position(levels: list[LevelConfig], i: int, key: str) -> None:
    """What each kind can sit on, and under: only the combinations that have no sound meaning are refused."""
    kind = levels[i].kind
    if i == 0 and kind in ("rejection", "smc"):
        raise ConfigError(f"{key}.kind={kind!r}: the bottom level must be 'model' or 'eagle3' ({kind} needs proposals)")
    if i > 0 and kind in ("model", "eagle3"):
        raise ConfigError(
            f"{key}.kind={kind!r} drafts at the bottom: it samples on its own and would ignore the levels below it"
        )
    if kind == "eagle3" and (len(levels) < 2 or levels[1].kind not in ("rejection", "smc")):
        raise ConfigError(
            f"{key}.kind='eagle3' drafts directly under a rejection or smc level: the head reads the features "
            "of the model above it"
        )
    if kind == "smc" and i != len(levels) - 1:
        raise ConfigError(
            f"{key}.kind='smc' must be the top level: its output is only approximately p_T^alpha and has no "
            "tractable probability, so no level can verify or reweight it"
        )


def _validate_smc(level: LevelConfig, below: LevelConfig, key: str) -> None:
    if level.particles <= 0:
        raise ConfigError(f"{key}.particles must be positive, got {level.particles}")
    if level.block_size < 0:
        raise ConfigError(f"{key}.block_size must be >= 0, got {level.block_size}")
    if level.alpha <= 0:
        raise ConfigError(f"{key}.alpha must be positive, got {level.alpha}")
    if level.temperature <= 0:
        raise ConfigError(f"{key}.temperature must be positive for smc (weights need p_T), got {level.temperature}")
    if not 0 <= level.ess_threshold <= 1:
        raise ConfigError(f"{key}.ess_threshold must lie in [0, 1], got {level.ess_threshold}")
    if level.resampling not in ("systematic", "multinomial"):
        raise ConfigError(f"{key}.resampling={level.resampling!r} is not one of systematic, multinomial")
    if level.selection not in ("sample", "argmax"):
        raise ConfigError(f"{key}.selection={level.selection!r} is not one of sample, argmax")
    if level.block_size > 0 and below.temperature <= 0:
        raise ConfigError(
            f"{key}: the proposal below an smc level must sample at temperature > 0 "
            f"(importance weights need q), but it has temperature {below.temperature}"
        )
