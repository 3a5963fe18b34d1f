"""`engine.kv_capacity_tokens: auto`: as many KV slots as the memory left after the weights holds.

Every model of a stack keeps its own KV pool with the same number of slots (a slot id means the same
token in every pool), so one slot costs the sum of the models' per-token KV bytes (plus each level's
block-table column). After the weights are loaded, the free memory minus a reserve for CUDA graphs and
activations (`RESERVE_BYTES` and `MARGIN` of what is free) divided by that sum is the capacity. The same
arithmetic runs in preflight on estimated weight bytes (from the configs, nothing loaded), so a stack
that cannot fit fails in a second with the numbers, not after minutes of loading.

`engine.max_batch_rows: auto` (the CUDA default) is decided first, from the same numbers: the most rows whose
logits reserve and requests' KV fit (`with_rows`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hsmc.config import HsmcConfig
from hsmc.errors import ConfigError, KVCapacityError
from hsmc.models.config import DecoderConfig

RESERVE_BYTES = 3 * 2**30  # CUDA graph pools, the levels' buffers, activations, cuBLAS workspaces
LOGIT_COPIES = 4  # fp32 logits of the widest forward live several times at once (logits, log-softmax, weights)
GRAPH_LOGIT_COPIES = 2  # and again in the pool of the graphed rounds / cycles (CUDA graphs)
# a warmup captures the rounds / cycles of every batch size: the graphs' pool then held about ten copies more (H100,
# docs/measurements/2026-11-27-h100-serve-bench.txt: 7 GB short for N=8 K=8 at 128 rows, 10.6 GB of pools at 96 x 17)
WARMUP_LOGIT_COPIES = 10
MARGIN = 0.08  # of the free memory: allocator fragmentation
GIB = 2**30


def kv_bytes_per_token(cfg: DecoderConfig, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """K and V of every layer for one token slot."""
    layers = cfg.num_layers if num_layers is None else num_layers
    return layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def block_table_bytes_per_token(max_rows: int) -> int:
    """One int64 column of a level's block table (rows + the scratch row) per slot."""
    return 8 * (max_rows + 1)


def reserve_bytes(cfg: HsmcConfig, vocab_size: int, largest_fp8_weight: int = 0, prefill_activations: int = 0) -> int:
    """Memory the pools must leave for the rest: a fixed part, the fp32 logits of the widest forward (every
    row with a verify block's tokens: an SMC cycle over 16 requests x 8 particles x 9 tokens of a 152k
    vocabulary holds 0.7 GB per copy), two bf16 copies of the largest FP8 matrix (`largest_fp8_weight`
    elements), which a forward of more rows than the FP8 kernel takes dequantizes, and the activations of one
    prefill chunk (`prefill_activation_bytes`). The first three were each found missing on an H200 when the
    pools took the rest (`hsmc bench --config`, tests/gpu's FP8 stack). With CUDA graphs a rejection
    round's or an SMC cycle's logits come again, in the graphs' pool (`Graphs`; every graph of a stack
    shares one): the larger of a round's `LOGIT_COPIES` and a cycle's `GRAPH_LOGIT_COPIES`. Measured on an
    H200 (`--sections cycles`, float64 weights scored a position at a time): an eager SMC cycle peaks at 7.8
    bytes per logit, the cycle graphs' pool holds 15-18 (its 2-3 captured shapes fit each other's blocks
    imperfectly), together 23-25 against the 24 reserved for a cycle. A warmup (`engine.warmup`) captures every batch
    size's: `WARMUP_LOGIT_COPIES` more."""
    rounds = [c.verify_positions for c in cfg.levels if c.kind == "rejection"]  # a verify's positions
    cycles = [c.block_size + 1 for c in cfg.levels if c.kind == "smc"]
    positions = LOGIT_COPIES * max([1, *rounds, *cycles])
    if cfg.engine.resolved_cuda_graphs:
        positions += max(LOGIT_COPIES * max(rounds, default=0), GRAPH_LOGIT_COPIES * max(cycles, default=0))
        if cfg.engine.warmup:
            positions += WARMUP_LOGIT_COPIES * max([0, *rounds, *cycles])
    logits = positions * cfg.engine.max_batch_rows * vocab_size * 4
    return RESERVE_BYTES + logits + 2 * largest_fp8_weight * 2 + prefill_activations


def prefill_activation_bytes(configs: list[DecoderConfig], element_size: int, tokens: int) -> int:
    """What one prefill forward of `tokens` tokens (`engine.prefill_chunk_tokens`) holds at once through the
    widest of the models: per token the residual stream, its normed copy and a layer's output, q/k/v and the
    attention output, gate/up and SiLU·mul (measured on an H200: 0.75 GiB for 8192 tokens of the Qwen3-8B
    shape in bf16, where this gives 0.91 GiB)."""
    per_token = max(
        3 * c.hidden_size + 2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim + 3 * c.intermediate_size
        for c in configs
    )
    return tokens * per_token * element_size


def largest_fp8_weight(modules: list[torch.nn.Module]) -> int:
    """Elements of the largest FP8 matrix among `modules` (0 when none holds FP8 weights)."""
    from hsmc.ops.fp8_linear import Fp8Linear

    return max(
        (m.weight.numel() for module in modules for m in module.modules() if isinstance(m, Fp8Linear)), default=0
    )


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: the driver's view once the allocator's cached blocks are handed back
    (what loading left cached is free for the pools), or the host's MemAvailable on the CPU."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"engine.device={str(device)!r} but no CUDA device is available")
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KVCapacityError("engine.kv_capacity_tokens=auto: cannot read the free host memory (/proc/meminfo)")


def most_useful_tokens(configs: list[DecoderConfig], max_rows: int) -> int:
    """More slots than every row filled to the models' longest context is waste; and a layer's cache must
    stay indexable in int32 (the Triton kernels' offsets), which small models on large GPUs would pass."""
    longest = min(c.max_position_embeddings for c in configs)
    indexable = min((2**31 - 1) // (c.num_kv_heads * c.head_dim) for c in configs) - 1
    return min(max_rows * longest, indexable)


def auto_capacity(
    free_bytes: int, per_token_bytes: list[int], minimum_tokens: int, what: str, *, most_tokens: int, reserve: int
) -> int:
    """Slots that fit in `free_bytes` minus `reserve` (`reserve_bytes`) and the margin, at most `most_tokens`
    (`most_useful_tokens`); KVCapacityError naming the numbers below `minimum_tokens`.

    `what` says whose memory this is ("free after the weights", "estimated free after ... GiB of weights").
    """
    per_token = sum(per_token_bytes)
    usable = int(free_bytes * (1 - MARGIN)) - reserve
    tokens = min(max(usable, 0) // per_token, most_tokens)
    if tokens < minimum_tokens:
        raise KVCapacityError(
            f"engine.kv_capacity_tokens=auto: {free_bytes / GIB:.1f} GiB {what}, less a {reserve / GIB:.1f} GiB "
            f"reserve and {MARGIN:.0%}, holds {tokens} KV slots at {per_token / 1024:.0f} KiB per slot "
            f"({len(per_token_bytes)} models), fewer than the {minimum_tokens} one prompt needs "
            "(rows x (max_new_tokens + lookahead)): use a smaller stack, fp8 weights, or a larger GPU"
        )
    return tokens


def _sizes(cfg: HsmcConfig, modules: list[torch.nn.Module]) -> tuple[list[int], int]:
    """Per model, the bytes one KV slot costs (with its block-table column), and the reserve (`reserve_bytes`)."""
    rows = cfg.engine.max_batch_rows
    table = block_table_bytes_per_token(rows)
    dtypes = [next(m.parameters()).dtype for m in modules]  # the embeddings' (an FP8 model's activations)
    # a tensor-parallel rank's layers (`layer_config`) hold its share of the KV heads and MLP
    per_token = [kv_bytes_per_token(m.layer_config, dtype) + table for m, dtype in zip(modules, dtypes)]
    element_size = max(dtype.itemsize for dtype in dtypes)
    layers = [m.layer_config for m in modules]
    activations = prefill_activation_bytes(layers, element_size, cfg.engine.prefill_chunk_tokens)
    return per_token, reserve_bytes(cfg, modules[-1].config.vocab_size, largest_fp8_weight(modules), activations)


def stack_capacity(cfg: HsmcConfig, modules: list[torch.nn.Module], free_bytes: int, what: str) -> int:
    """`auto_capacity` for `cfg`'s stack of `modules` (one per level, loaded or on the meta device: only
    configs, dtypes and FP8 layouts are read), in `free_bytes` of memory described by `what` (`cfg`'s rows
    resolved: `with_rows`)."""
    from hsmc.engine.scheduler import minimum_kv_tokens

    per_token, reserve = _sizes(cfg, modules)
    most = most_useful_tokens([m.layer_config for m in modules], cfg.engine.max_batch_rows)
    return auto_capacity(free_bytes, per_token, minimum_kv_tokens(cfg), what, most_tokens=most, reserve=reserve)


AUTO_ROWS = 256  # the most rows "auto" gives: CUDA graphs are captured for every row bucket up to it
PROMPT_TOKENS = 512  # the prompt a request is assumed to bring when "auto" sizes the rows


def with_rows(cfg: HsmcConfig, modules: list[torch.nn.Module], free_bytes: int) -> HsmcConfig:
    """`cfg` with engine.max_batch_rows a number: as configured, or for "auto" the most rows (a power of two, at
    most AUTO_ROWS) whose logits reserve and KV fit in `free_bytes` with every row busy: each request a group
    of N rows (an smc top's particles, else 1) with a PROMPT_TOKENS-token prompt and max_new_tokens to decode.
    The KV pool then takes what is left (`kv_capacity_tokens: auto`)."""
    from hsmc.engine.scheduler import rows_and_lookahead

    rows = cfg.engine.resolved_max_batch_rows
    if isinstance(rows, int):
        return _rows(cfg, rows)
    group, lookahead = rows_and_lookahead(cfg)
    request_tokens = PROMPT_TOKENS + group * (cfg.generation.max_new_tokens + lookahead)
    rows = AUTO_ROWS
    while rows > group:
        trial = _rows(cfg, rows)
        per_token, reserve = _sizes(trial, modules)
        if reserve + (rows // group) * request_tokens * sum(per_token) <= free_bytes * (1 - MARGIN):
            break
        rows //= 2
    return _rows(cfg, max(rows, group))


def _rows(cfg: HsmcConfig, rows: int) -> HsmcConfig:
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_batch_rows=rows))
