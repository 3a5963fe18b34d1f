"""Build a level stack from a validated config: load each model once, wire each level to the one below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hsmc.config import HsmcConfig, LevelConfig
from hsmc.eagle.checkpoint import capture_layers, load_eagle3_head, random_eagle3_head
from hsmc.engine.graphs import GraphScope
from hsmc.engine.host_io import upload
from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.kv_sizing import free_memory, stack_capacity, with_rows
from hsmc.engine.random_streams import RowStreams
from hsmc.engine.runner import ModelRunner, context_buckets
from hsmc.engine.sampler import RowLaws
from hsmc.engine.scheduler import lookahead_tokens
from hsmc.engine.tops import Group
from hsmc.errors import ConfigError
from hsmc.levels.base import Level, SequenceState
from hsmc.levels.draft_length import DraftLength, RoundTimes
from hsmc.levels.eagle3 import Eagle3Level
from hsmc.levels.model import ModelLevel
from hsmc.levels.rejection import RejectionLevel
from hsmc.levels.smc import SMCLevel, SMCParams
from hsmc.levels.tree import TreeShape
from hsmc.models.loading import LoadedModel, load_model
from hsmc.models.parallel import SINGLE, TensorParallel
from hsmc.models.shapes import SHAPES, random_loaded, random_shape
from hsmc.ops.backend import Backend, TorchBackend
from hsmc.ops.fp8_linear import Fp8Linear


@dataclass
class Stack:
    levels: list[Any]  # ModelLevel | RejectionLevel | SMCLevel, bottom to top
    configs: list[LevelConfig]
    tokenizer: Any | None
    eos_token_ids: tuple[int, ...]
    streams: RowStreams  # every row's random streams, shared by the levels
    capacity: int  # KV slots of every model's pool (engine.kv_capacity_tokens, resolved when "auto")
    max_rows: int  # engine.max_batch_rows, resolved when "auto"
    device: torch.device
    scope: GraphScope  # what the levels' graphed units (forwards, rounds, cycles) share
    resets: int = 0  # times the levels' statistics were reset (`reset_stats`)

    @property
    def top(self) -> Any:
        return self.levels[-1]

    @property
    def is_smc(self) -> bool:
        return isinstance(self.top, SMCLevel)

    @property
    def runners(self) -> list[ModelRunner]:
        """Each level's runner, bottom to top (an EAGLE3 level's runs its head)."""
        return [lv.runner if hasattr(lv, "runner") else lv.state.runner for lv in self.levels]

    @property
    def rows_per_prompt(self) -> int:
        return self.top.params.particles if self.is_smc else 1

    def assign(self, groups: list[Group]) -> None:
        """The random streams of newly admitted requests' rows (particle i of a request seeded s: the stream (s, i))
        and their law at the top level (the request's temperature, top_k, top_p)."""
        rows = [r for g in groups for r in g.rows]
        seeds = [g.request.params.seed for g in groups for _ in g.rows]
        particles = [i for g in groups for i in range(len(g.rows))]
        index = upload(torch.tensor([rows, seeds, particles], dtype=torch.int64), self.device)
        self.streams.seed(*index)
        laws = [(g.request.params.temperature, g.request.params.top_k, g.request.params.top_p) for g in groups]
        self.top.laws.assign(rows, [law for g, law in zip(groups, laws) for _ in g.rows])

    def clear(self, rows: list[int]) -> None:
        """Released rows: the top level's law forgets them."""
        self.top.laws.clear(rows)

    def reset_stats(self) -> None:
        """Every level's statistics start again (a rejection level's acceptance counts among them, which a block
        fill plans from)."""
        self.resets += 1
        for level in self.levels:
            level.reset_stats()

    @property
    def choice(self) -> Any:
        """The top's adaptive choice a warmup or the start-up timing may force: an smc top's block fill (its rounds
        R) or a rejection top's draft shape (`num_draft_tokens: auto`); None without one."""
        if self.is_smc:
            return self.top.proposal.fill
        return self.top.draft_length if isinstance(self.top, RejectionLevel) else None

    @property
    def mode(self) -> tuple[str, int | None, int, bool, RoundTimes | None]:
        """What the host sets on the stack, besides requests, that changes its device work: the graph scope's
        capturing and a forced choice (`choice`: both set by the warmup or the draft shapes' timing), the
        statistics resets (a block fill's plans follow its acceptance counts), whether SMC cycles replay their
        graphs (`hsmc bench` times them op by op too) and the draft shapes' round and catch-up times (rank 0 times
        them; the choice follows them and the reads, which every rank makes alike). Tensor-parallel ranks share it,
        so they run the same forwards and collectives."""
        choice = self.choice
        replay = self.top.replay_cycles if self.is_smc else True
        times = None
        if isinstance(choice, DraftLength) and choice.round_ms is not None:
            times = (choice.round_ms, choice.catch_up_ms)
        forced = choice.forced if choice is not None else None
        return self.scope.capturing, forced, self.resets, replay, times

    def set_mode(self, mode: tuple[str, int | None, int, bool, RoundTimes | None]) -> None:
        capturing, forced, resets, replay, times = mode
        self.scope.capturing = capturing  # type: ignore[assignment]
        if self.is_smc:
            self.top.replay_cycles = replay
        choice = self.choice
        if choice is not None:
            choice.forced = forced
        if times is not None and (choice.round_ms, choice.catch_up_ms) != times:  # rank 0's timing ended: it forgot
            choice.round_ms = {rows: list(ms) for rows, ms in times[0].items()}  # what it read
            choice.catch_up_ms = dict(times[1])
            choice.forget()
        if resets != self.resets:
            self.reset_stats()
            self.resets = resets

    @property
    def lookahead(self) -> int:
        """Tokens a row may hold past its output before they are rejected or returned."""
        return lookahead_tokens(self.configs)


def make_backend(name: str) -> Backend:
    """The kernel backend `engine.attention` names (Triton is imported only when asked for)."""
    if name == "triton":
        from hsmc.ops.triton_backend import TritonBackend

        return TritonBackend()
    return TorchBackend()


def _set_fp8_activations(modules: list[nn.Module], dynamic: bool) -> None:
    """Every FP8 Linear of the stack's models follows `engine.fp8_activations` (models passed in included)."""
    linears = [m for module in modules for m in module.modules() if isinstance(m, Fp8Linear)]
    if dynamic and not linears:
        raise ConfigError(
            "engine.fp8_activations=true but no level's model has FP8 weights (an FP8 checkpoint, or dtype: fp8)"
        )
    for linear in linears:
        linear.dynamic_activations = dynamic


def build_stack(cfg: HsmcConfig, models: dict[str, LoadedModel] | None = None, tp: TensorParallel = SINGLE) -> Stack:
    """The levels of `cfg`; `tp`: the tensor-parallel rank whose shard of every model this process holds (an
    EAGLE3 head stays whole on every rank)."""
    device = torch.device(cfg.engine.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"engine.device={cfg.engine.device!r} but no CUDA device is available")
    backend = make_backend(cfg.engine.resolved_attention)
    graphs = cfg.engine.resolved_cuda_graphs
    loaded: dict[tuple[str, str, int | None], LoadedModel] = {}

    def model_of(lc: LevelConfig) -> LoadedModel:
        if models and lc.model in models:
            return models[lc.model]
        key = (lc.model, lc.dtype, lc.num_layers)
        if key not in loaded:
            shape = random_shape(lc.model)
            if shape is not None:
                loaded[key] = random_loaded(shape, lc.dtype, device, lc.num_layers, tp)
            else:
                loaded[key] = load_model(lc.model, lc.dtype, device, lc.num_layers, tp)
        return loaded[key]

    def tables() -> BlockTables:
        return BlockTables(SlotAllocator(capacity, device), rows, capacity, backend)

    def head_of(lc: LevelConfig) -> tuple[Any, Any]:
        shape = random_shape(lc.model)
        if shape is not None:
            return random_eagle3_head(SHAPES[shape], lc.dtype, device)
        return load_eagle3_head(lc.model, lc.dtype, device)

    # every weight first: an auto-sized KV pool takes what is free after all of them
    heads = {i: head_of(lc) for i, lc in enumerate(cfg.levels) if lc.kind == "eagle3"}
    modules = [heads[i][0] if i in heads else model_of(lc).model for i, lc in enumerate(cfg.levels)]
    _set_fp8_activations(modules, cfg.engine.fp8_activations)
    cfg = _with_rows(cfg, modules, device)
    rows = cfg.engine.max_batch_rows
    capacity = _kv_capacity(cfg, modules, device)
    streams = RowStreams(rows, device, backend)
    scope = GraphScope(context_buckets(capacity))
    run = cfg.levels[-1].particles if cfg.levels[-1].kind == "smc" else 1  # every level's rows are its particles
    levels: list[Any] = []
    vocabularies: list[tuple[int, Any | None]] = []  # (vocab size, tokenizer) per level
    for i, lc in enumerate(cfg.levels):
        # a level's draws are salted by its depth under the top: the top draws the same stream in every stack (an
        # smc top with K = 0 and N = 1 gives exactly its model's samples)
        laws, salt = RowLaws(lc.temperature, rows, device, backend), len(cfg.levels) - 1 - i
        if lc.kind == "eagle3":
            above = cfg.levels[i + 1]
            verifier = model_of(above).model
            head, head_config = heads[i]
            layers = capture_layers(head_config, verifier.config.num_layers)
            runner = ModelRunner(head, tables(), backend, num_layers=1, cuda_graphs=graphs, scope=scope, prefix_run=run)
            embed = verifier.model.embed_tokens
            if above.kind == "smc" and head.draft_vocab_size < head.config.vocab_size:
                raise ConfigError(
                    f"levels[{i}].model={lc.model!r} drafts {head.draft_vocab_size} of the {head.config.vocab_size} "
                    "tokens; an smc proposal must be able to propose every token (importance weights need q > 0 "
                    "wherever p_T^alpha > 0): put a rejection level between the head and the smc level"
                )
            block = above.block_size if above.kind == "smc" else above.path_length
            pairs, bridged = block + 1, len(cfg.levels) - 2  # one per level above the verifier
            levels.append(
                Eagle3Level(
                    runner, embed, layers, rows, capacity, pairs, bridged, laws, streams, salt,
                    prefill_chunk_tokens=cfg.engine.prefill_chunk_tokens,
                )
            )  # fmt: skip
            vocabularies.append((head.config.vocab_size, None))
            continue
        model = model_of(lc)
        vocabularies.append((model.model.config.vocab_size, model.tokenizer))
        below: Level | None = levels[-1] if levels else None
        capture = below.feature_layers if below is not None else ()
        num_layers = model.model.config.num_layers
        runner = ModelRunner(model.model, tables(), backend, num_layers, graphs, scope, prefix_run=run, capture=capture)
        state = SequenceState(runner, rows, capacity, cfg.engine.prefill_chunk_tokens)
        if lc.kind == "model":
            is_top = i == len(cfg.levels) - 1
            levels.append(ModelLevel(state, laws, streams, salt, graph_steps=graphs and is_top))
        elif lc.kind == "rejection":
            drafts_for_rejection = i + 1 < len(cfg.levels) and cfg.levels[i + 1].kind == "rejection"
            trees = [TreeShape(t.depth, t.topk, t.budget) for t in lc.trees]
            choice = DraftLength(lc.most_drafts, trees if lc.tree == "auto" else ()) if lc.chooses_shape else None
            fixed_tree = trees[0] if trees and choice is None else None
            levels.append(
                RejectionLevel(
                    state, below, lc.most_drafts, laws, streams, salt,
                    graph_rounds=graphs and not drafts_for_rejection, tree=fixed_tree,
                    tree_rule=lc.tree_rule, draft_length=choice,
                )
            )  # fmt: skip
        else:
            params = SMCParams(
                lc.particles, lc.block_size, lc.alpha, lc.temperature, lc.ess_threshold, lc.resampling, lc.selection
            )
            stop_ids = tuple(model.model.config.eos_token_ids)
            levels.append(SMCLevel(state, below, params, laws, streams, salt, stop_ids, graph_cycles=graphs))
    _check_same_vocabulary(cfg.levels, vocabularies)
    tokenizer = next((t for _, t in reversed(vocabularies) if t is not None), None)
    top = model_of(cfg.levels[-1]).model
    eos = top.config.eos_token_ids
    return Stack(levels, list(cfg.levels), tokenizer, eos, streams, capacity, rows, device, scope)


def _with_rows(cfg: HsmcConfig, modules: list[Any], device: torch.device) -> HsmcConfig:
    """`cfg` with its rows a number (engine.max_batch_rows, sized from the free memory when "auto")."""
    if isinstance(cfg.engine.resolved_max_batch_rows, int):
        return with_rows(cfg, modules, 0)
    return with_rows(cfg, modules, free_memory(device))


def _kv_capacity(cfg: HsmcConfig, modules: list[Any], device: torch.device) -> int:
    """engine.kv_capacity_tokens, or for "auto" what the memory free after the loaded weights holds."""
    capacity = cfg.engine.resolved_kv_capacity
    if isinstance(capacity, int):
        return capacity
    return stack_capacity(cfg, modules, free_memory(device), "free after the weights")


def _check_same_vocabulary(configs: list[LevelConfig], vocabularies: list[tuple[int, Any | None]]) -> None:
    """Levels exchange token ids, so every model must use the same vocabulary."""
    top_size, top_tokenizer = vocabularies[-1]
    for i, (lc, (size, tokenizer)) in enumerate(zip(configs, vocabularies)):
        if size != top_size:
            raise ConfigError(
                f"levels[{i}].model={lc.model!r} has vocab_size {size}, but the top level "
                f"{configs[-1].model!r} has {top_size}: levels must share one vocabulary"
            )
        if tokenizer is not None and top_tokenizer is not None and tokenizer.get_vocab() != top_tokenizer.get_vocab():
            raise ConfigError(
                f"levels[{i}].model={lc.model!r} uses a different tokenizer than the top level {configs[-1].model!r}"
            )
