"""Typed run configuration: omegaconf structured config from YAML plus `key=value` overrides.

omegaconf checks types and unknown keys against the dataclasses below (its messages name the
full key); `validate` adds the cross-field rules. Every error becomes a one-line `ConfigError`
that names where the value came from (the file or the override) and the offending key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hsmc.errors import ConfigError
from hsmc.speculative.tree_verify import DRAWN_RULES

T = TypeVar("T")
LEVEL_KINDS = ("model", "eagle3", "rejection", "smc")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "fp8")  # fp8: block-scaled FP8 weights, bf16 activations
ATTENTION_BACKENDS = ("torch", "triton")


@dataclass
class TreeConfig:
    depth: int = 4  # deepest draft
    topk: int = 2  # children per expanded node, nodes expanded per depth
    budget: int = 8  # drafts verified per round (the best by cumulative draft log-probability)


TREE_RULES = ("target_only", *DRAWN_RULES)
AUTO_MOST_DRAFTS = 8  # num_draft_tokens: auto chooses each round's γ in 0..8
# tree: auto chooses each round's draft among chains and these trees (the shapes scripts/tree_acceptance.py measures)
AUTO_TREES = (TreeConfig(3, 2, 4), TreeConfig(4, 3, 8), TreeConfig(5, 4, 16), TreeConfig(6, 6, 32))


@dataclass
class LevelConfig:
    kind: str = "model"  # model | eagle3 | rejection | smc, listed bottom (cheapest) to top
    model: str = MISSING  # hub id | local folder | .gguf path | demo short name (eagle3: the head's folder/id)
    dtype: str = "float32"
    temperature: float = 0.0
    num_layers: int | None = None  # keep only the first n decoder layers (a cheap self-draft)
    # rejection: γ drafts verified per round, or "auto": each round's γ in 0..AUTO_MOST_DRAFTS (0: the target alone)
    # for the most expected tokens per second, from round times measured at start and the acceptance seen so far
    # (hsmc/levels/draft_length.py); auto is for a rejection level at the top of the stack
    num_draft_tokens: int | str = 4
    # rejection: draft trees of this shape instead of chains (see docs/design.md), or "auto": each round a chain of up
    # to num_draft_tokens drafts (none included) or one of AUTO_TREES, chosen as num_draft_tokens: auto chooses γ
    tree: TreeConfig | str | None = None
    tree_rule: str = "target_only"  # rejection with a tree: target_only | draft_aware | traversal
    particles: int = 4  # smc: N
    block_size: int = 4  # smc: K proposal tokens per cycle (0 = target-only sampling)
    alpha: float = 1.0  # smc: target is p_T^alpha
    ess_threshold: float = 0.5  # smc: resample when ESS < τ·N (0 disables)
    resampling: str = "systematic"  # smc: systematic | multinomial
    selection: str = "sample"  # smc: sample | argmax

    @property
    def most_drafts(self) -> int:
        """rejection: the most drafts a chain round verifies (γ, or AUTO_MOST_DRAFTS for "auto")."""
        return AUTO_MOST_DRAFTS if self.num_draft_tokens == "auto" else self.num_draft_tokens  # type: ignore[return-value]

    @property
    def chooses_shape(self) -> bool:
        """rejection: each round's draft shape is chosen (num_draft_tokens or tree "auto")."""
        return "auto" in (self.num_draft_tokens, self.tree)

    @property
    def trees(self) -> tuple[TreeConfig, ...]:
        """rejection: the tree shapes its rounds may draft."""
        return AUTO_TREES if self.tree == "auto" else () if self.tree is None else (self.tree,)  # type: ignore[return-value]

    @property
    def _round_shapes(self) -> list[tuple[int, int]]:
        """rejection: (drafts a round may keep, drafts it verifies) of each shape it may draft: its chain, its trees."""
        chain = [] if isinstance(self.tree, TreeConfig) else [(self.most_drafts, self.most_drafts)]
        return chain + [(t.depth, t.budget) for t in self.trees]

    @property
    def path_length(self) -> int:
        """rejection: most drafts one round keeps (γ, or a tree's depth)."""
        return max(kept for kept, _ in self._round_shapes)

    @property
    def verify_positions(self) -> int:
        """rejection: positions one verify forward runs (γ + 1, or a tree's budget + 1), in the KV until it ends."""
        return max(verified for _, verified in self._round_shapes) + 1


# The LevelConfig keys only one kind reads: set on a level of another kind they would change nothing, so they are
# refused (`tree` on the drafter below a rejection level, `particles` on a rejection level)
KIND_KEYS = {
    "rejection": ("num_draft_tokens", "tree", "tree_rule"),
    "smc": ("particles", "block_size", "alpha", "ess_threshold", "resampling", "selection"),
}


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
    # rows decoded together (an smc request takes N): a number, or "auto" (as many as the GPU's memory holds with
    # room for their requests' KV, at most 256; see hsmc/engine/kv_sizing.py); default: auto on cuda, 16 elsewhere
    max_batch_rows: int | str | None = None
    # KV slots per model: a number, or "auto" (sized from the memory free after the weights, see
    # hsmc/engine/kv_sizing.py); default: auto on cuda, 4096 elsewhere
    kv_capacity_tokens: int | str | None = None
    attention: str | None = None  # kernel backend: torch | triton; default triton on cuda, torch elsewhere
    cuda_graphs: bool | None = None  # replay captured CUDA graphs for decode/verify forwards; default: on cuda
    # FP8 models: quantize the input of a Linear over >= 2 rows per row and 128 columns (the checkpoints'
    # activation_scheme: dynamic) and multiply on the FP8 tensor cores; faster verify/prefill, lossier
    fp8_activations: bool = False
    # most tokens one prefill forward runs (rows x tokens per row): longer prompts are prefilled in chunks, so
    # a batch of long prompts needs activations for this many tokens, not for all of them at once
    prefill_chunk_tokens: int = 8192
    # capture every CUDA graph the config's batch shapes need before the first request (`hsmc serve` always does),
    # so no request pays a capture; shapes first seen later run without a graph instead
    warmup: bool = False
    # GPUs (CPU processes on the CPU) every model of the stack is sharded over: heads, MLP and vocabulary split
    # (hsmc/models/parallel.py), one process per rank started by hsmc itself (hsmc/engine/ranks.py)
    tensor_parallel: int = 1

    @property
    def resolved_attention(self) -> str:
        return self.attention or ("triton" if self.device.startswith("cuda") else "torch")

    @property
    def resolved_kv_capacity(self) -> int | str:
        """A number of slots, or "auto"."""
        if self.kv_capacity_tokens is None:
            return "auto" if self.device.startswith("cuda") else 4096
        return self.kv_capacity_tokens

    @property
    def resolved_max_batch_rows(self) -> int | str:
        """A number of rows, or "auto" (which only a CUDA device sizes: elsewhere it is 16)."""
        rows = self.max_batch_rows
        if rows is None or rows == "auto":
            return "auto" if self.device.startswith("cuda") else 16
        return rows

    @property
    def resolved_cuda_graphs(self) -> bool:
        return self.device.startswith("cuda") if self.cuda_graphs is None else self.cuda_graphs


@dataclass
class HsmcConfig:
    levels: list[LevelConfig] = field(default_factory=list)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prompts: list[str] = field(default_factory=list)  # used when none are given on the command line


def level_label(i: int, level: LevelConfig) -> str:
    """How messages name a level: `levels[1] (rejection)`."""
    return f"levels[{i}] ({level.kind})"


def load_config(source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HsmcConfig:
    """Merge the schema defaults, a YAML file (or mapping) and dotlist overrides, then validate."""
    cfg = load_structured(HsmcConfig, source, overrides)
    validate(cfg, _source_name(source), overrides)
    return cfg


def load_structured(schema: type[T], source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> T:
    """An instance of the dataclass `schema` from YAML (or a mapping) plus `key=value` overrides.

    An error names where it comes from: the YAML file (with line and column for a syntax error) or
    the override, and the full key; omegaconf's own multi-line details are cut to their first line.
    """
    where = _source_name(source)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), _read_source(source))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {_one_line(e)}") from None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _check_list_indices(merged, key, item)
        try:
            OmegaConf.update(merged, key, yaml.safe_load(value), merge=True)  # `levels.0.x` indexes lists
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {item!r}: {_one_line(e)}") from None
    try:
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {_one_line(e)}") from None


def _source_name(source: str | Path | DictConfig | dict) -> str:
    return str(source) if isinstance(source, (str, Path)) else "config"


def _read_source(source: str | Path | DictConfig | dict) -> DictConfig:
    if not isinstance(source, (str, Path)):
        return OmegaConf.create(source)
    if not Path(source).is_file():
        raise ConfigError(f"config file not found: {source}")
    try:
        data = OmegaConf.load(source)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: YAML syntax error{at}: {e.problem or e.context}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"{source}: expected a mapping of config keys, found a {type(data).__name__}")
    return data


def _one_line(e: OmegaConfBaseException) -> str:
    """omegaconf's message without its `full_key:` / `reference_type=` detail lines, prefixed by the full key."""
    first = str(e).splitlines()[0].strip() if str(e) else type(e).__name__
    key = getattr(e, "full_key", None)
    return f"{key}: {first}" if key else first


def _check_list_indices(cfg: DictConfig, key: str, item: str) -> None:
    """An override that indexes a list must name an existing entry (omegaconf's own error for
    `levels.5.model=x` on a 3-level config is about dataclass types)."""
    node: object = cfg
    path: list[str] = []
    for part in key.split("."):
        if OmegaConf.is_list(node):
            prefix = ".".join(path)
            if not part.isdigit():
                raise ConfigError(f"override {item!r}: {prefix} is a list, so {part!r} must be an index (0, 1, ...)")
            if int(part) >= len(node):
                have = f"indices 0..{len(node) - 1}" if len(node) else "none"
                raise ConfigError(
                    f"override {item!r}: index {part} is out of range: the config has {len(node)} {prefix} ({have})"
                )
            node = node[int(part)]
        elif OmegaConf.is_dict(node) and part in node:
            node = node[part]
        else:
            return  # an unknown key: omegaconf's error names it
        path.append(part)


def validate(cfg: HsmcConfig, where: str = "config", overrides: Sequence[str] = ()) -> None:
    """Raise a ConfigError for the first cross-field rule `cfg` breaks.

    The message starts with where the offending key was set: the override that set it (or a key
    containing it), else `where` (the YAML file).
    """
    for key, problem in _problems(cfg):
        raise ConfigError(f"{_origin(key, where, overrides)}: {key}{problem}")


def _origin(key: str, where: str, overrides: Sequence[str]) -> str:
    parts = key.replace("[", ".").replace("]", "").split(".")
    for item in reversed(overrides):  # the last override of a key wins
        set_parts = item.partition("=")[0].split(".")
        n = min(len(parts), len(set_parts))
        if parts[:n] == set_parts[:n]:
            return f"override {item!r}"
    return where


def _problems(cfg: HsmcConfig) -> Iterator[tuple[str, str]]:
    """(key, what is wrong with it) for every broken rule, in the order a reader checks them."""
    if not cfg.levels:
        yield "levels", ": at least one level is required"
    for i, level in enumerate(cfg.levels):
        key = f"levels[{i}]"
        if level.kind not in LEVEL_KINDS:
            yield f"{key}.kind", f"={level.kind!r} is not one of {', '.join(LEVEL_KINDS)}"
        if level.dtype not in DTYPE_NAMES:
            yield f"{key}.dtype", f"={level.dtype!r} is not one of {', '.join(DTYPE_NAMES)}"
        if level.kind == "eagle3" and level.dtype == "fp8":
            yield f"{key}.dtype", "='fp8' is for decoder models; an EAGLE3 head loads as float32, bfloat16 or float16"
        if level.temperature < 0:
            yield f"{key}.temperature", f" must be >= 0, got {level.temperature}"
        if level.num_layers is not None and level.num_layers <= 0:
            yield f"{key}.num_layers", f" must be positive, got {level.num_layers}"
        yield from _foreign_key_problems(level, key)
        if level.kind == "rejection":
            yield from _draft_count_problems(cfg, i, key)
            if level.tree_rule not in TREE_RULES:
                yield f"{key}.tree_rule", f"={level.tree_rule!r} is not one of {', '.join(TREE_RULES)}"
            elif level.tree is None and level.tree_rule != "target_only":
                yield (
                    f"{key}.tree_rule",
                    f"={level.tree_rule!r} verifies draft trees; this level drafts chains (no tree)",
                )
        if level.kind == "rejection" and isinstance(level.tree, str) and level.tree != "auto":
            yield f"{key}.tree", f"={level.tree!r} is neither a tree shape (depth, topk, budget) nor 'auto'"
        elif level.kind == "rejection":
            for tree in level.trees:
                yield from _tree_problems(tree, level.tree_rule, cfg.levels[i - 1] if i else None, key)
        yield from _position_problems(cfg.levels, i)
        if level.kind == "smc":
            yield from _smc_problems(level, cfg.levels[i - 1], i)
    engine = cfg.engine
    if engine.attention not in (None, *ATTENTION_BACKENDS):
        yield "engine.attention", f"={engine.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
    if engine.resolved_cuda_graphs and not engine.device.startswith("cuda"):
        yield "engine.cuda_graphs", f"=true needs engine.device=cuda, not {engine.device!r}"
    capacity = engine.resolved_kv_capacity
    if isinstance(capacity, str) and capacity != "auto":
        yield "engine.kv_capacity_tokens", f"={capacity!r} is neither a number of slots nor 'auto'"
    rows = engine.resolved_max_batch_rows
    if isinstance(rows, str) and rows != "auto":
        yield "engine.max_batch_rows", f"={rows!r} is neither a number of rows nor 'auto'"
    if engine.tensor_parallel < 1:
        yield "engine.tensor_parallel", f"={engine.tensor_parallel} must be >= 1"
    if engine.tensor_parallel > 1 and engine.device.startswith("cuda:"):
        yield (
            "engine.device",
            f"={engine.device!r}: with engine.tensor_parallel rank i runs on cuda:i; pick the GPUs with "
            "CUDA_VISIBLE_DEVICES and set engine.device=cuda",
        )
    for key, value in (
        ("generation.max_new_tokens", cfg.generation.max_new_tokens),
        ("engine.max_batch_rows", rows if isinstance(rows, int) else 1),
        ("engine.prefill_chunk_tokens", cfg.engine.prefill_chunk_tokens),
        ("engine.kv_capacity_tokens", capacity if isinstance(capacity, int) else 1),
    ):
        if value <= 0:
            yield key, f" must be positive, got {value}"


def _foreign_key_problems(level: LevelConfig, key: str) -> Iterator[tuple[str, str]]:
    """Keys of another kind set on this level (given a value other than their default)."""
    defaults = {f.name: f.default for f in fields(LevelConfig) if f.default is not NO_DEFAULT}
    for kind, names in KIND_KEYS.items():
        if level.kind == kind:
            continue
        for name in names:
            if getattr(level, name) != defaults[name]:
                yield f"{key}.{name}", f" is a key of {kind!r} levels; this level is {level.kind!r}"


def _draft_count_problems(cfg: HsmcConfig, i: int, key: str) -> Iterator[tuple[str, str]]:
    level, auto = cfg.levels[i], cfg.levels[i].num_draft_tokens == "auto"
    chosen = f"{key}.num_draft_tokens" if auto else f"{key}.tree"  # the key that asks for a chosen shape
    if isinstance(level.num_draft_tokens, str) and not auto:
        yield f"{key}.num_draft_tokens", f"={level.num_draft_tokens!r} is neither a number of drafts nor 'auto'"
    elif not auto and level.num_draft_tokens <= 0:  # type: ignore[operator]
        yield f"{key}.num_draft_tokens", f" must be positive, got {level.num_draft_tokens}"
    elif auto and isinstance(level.tree, TreeConfig):
        yield f"{key}.num_draft_tokens", "='auto' chooses chain lengths; with a tree the tree's shape is fixed"
    elif level.chooses_shape and i + 1 < len(cfg.levels):
        yield (
            chosen,
            "='auto' is for the rejection level at the top of the stack: under another level its rounds are planned "
            f"for one draft shape (under {cfg.levels[i + 1].kind!r} here); give a number or a tree",
        )


def _tree_problems(tree: TreeConfig, rule: str, below: LevelConfig | None, key: str) -> Iterator[tuple[str, str]]:
    for name in ("depth", "topk", "budget"):
        if getattr(tree, name) <= 0:
            yield f"{key}.tree.{name}", f" must be positive, got {getattr(tree, name)}"
    most = tree.topk + (tree.depth - 1) * tree.topk**2
    if tree.budget > most:
        yield f"{key}.tree.budget", f"={tree.budget} exceeds the {most} nodes a tree of this depth and topk drafts"
    if below is not None and below.kind not in ("model", "eagle3"):
        yield f"{key}.tree", f": trees are drafted by a 'model' or 'eagle3' level, not by {below.kind!r}"
    if below is not None and rule in DRAWN_RULES and below.temperature <= 0:
        yield (
            f"{key}.tree_rule",
            f"={rule!r} draws children without replacement from the drafter's law: the level below needs "
            f"temperature > 0, got {below.temperature}",
        )


def _position_problems(levels: list[LevelConfig], i: int) -> Iterator[tuple[str, str]]:
    """What each kind can sit on, and under: only the combinations that have no sound meaning are refused."""
    kind, key = levels[i].kind, f"levels[{i}].kind"
    if i == 0 and kind in ("rejection", "smc"):
        yield key, f"={kind!r}: the bottom level must be 'model' or 'eagle3' ({kind} needs proposals)"
    if i > 0 and kind in ("model", "eagle3"):
        yield key, f"={kind!r} drafts at the bottom: it samples on its own and would ignore the levels below it"
    if kind == "eagle3" and (len(levels) < 2 or levels[1].kind not in ("rejection", "smc")):
        yield (
            key,
            "='eagle3' drafts directly under a rejection or smc level: the head reads the features of the model "
            "above it",
        )
    if kind == "smc" and i != len(levels) - 1:
        yield (
            key,
            "='smc' must be the top level: its output is only approximately p_T^alpha and has no tractable "
            "probability, so no level can verify or reweight it",
        )


def _smc_problems(level: LevelConfig, below: LevelConfig, i: int) -> Iterator[tuple[str, str]]:
    key = f"levels[{i}]"
    if level.particles <= 0:
        yield f"{key}.particles", f" must be positive, got {level.particles}"
    if level.block_size < 0:
        yield f"{key}.block_size", f" must be >= 0, got {level.block_size}"
    if level.alpha <= 0:
        yield f"{key}.alpha", f" must be positive, got {level.alpha}"
    if level.temperature <= 0:
        yield f"{key}.temperature", f" must be positive for smc (weights need p_T), got {level.temperature}"
    if not 0 <= level.ess_threshold <= 1:
        yield f"{key}.ess_threshold", f" must lie in [0, 1], got {level.ess_threshold}"
    if level.resampling not in ("systematic", "multinomial"):
        yield f"{key}.resampling", f"={level.resampling!r} is not one of systematic, multinomial"
    if level.selection not in ("sample", "argmax"):
        yield f"{key}.selection", f"={level.selection!r} is not one of sample, argmax"
    if level.block_size > 0 and below.temperature <= 0:
        yield (
            f"levels[{i - 1}].temperature",
            f"={below.temperature}: the proposal below an smc level must sample at temperature > 0 "
            f"(importance weights need q; or set levels[{i}].block_size=0)",
        )
