"""Reductions over a row of logits in one pass: a Gumbel-max draw with its log-probability, and log-normalizers
(`TritonBackend.gumbel_max` / `logsumexp_rows`; `TorchBackend`'s are the reference).

In torch a draw reads each row of logits (152k values for Qwen3) about fourteen times in separate kernels on the
chain of a graphed cycle; here programs reduce blocks of the row to partial results and one small kernel per row
combines them. Each row brings its own scale (1 / temperature, 0 for greedy), top-k / top-p floor and key; the
noise is Philox keyed by the row's key with the column as counter, so a seeded request draws the same tokens in
any batch, with no host read (graph-capturable). The reference's noise is `counter_hash`'s splitmix64: the same law,
other bits; the tests hold both to the exact law.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per program


@triton.jit
def _row_block(logits_ptr, V, stride_row, BLOCK: tl.constexpr):
    """Block `program_id(1)` of row `program_id(0)` as stored, -inf past the row: (row, block, columns,
    values)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < V, other=float("-inf"))
    return row, block, cols, z


@triton.jit
def _max_and_sum_exp(x):
    """The max of x and the sum of exp(x - max) (a block of -inf gives -inf and 0)."""
    m = tl.max(x, 0)
    return m, tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)


@triton.jit
def _combined_lse(m, s):
    """The log-sum-exp of blocks with maxima m and sums of exp(x - m) s."""
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    return top_safe + tl.log(tl.sum(s * tl.exp(m - top_safe), 0))


@triton.jit
def _gumbel_partials(
    logits_ptr, scale_ptr, floor_ptr, keys_ptr, part_ptr, V, stride_row, num_blocks, BLOCK: tl.constexpr
):  # fmt: skip
    """Block `program_id(1)` of row `program_id(0)`: (best score, its column, its scaled logit, max, sum exp)
    over the entries at or above the row's floor. A greedy row (scale 0) scores the raw logits, without noise."""
    row, block, cols, z = _row_block(logits_ptr, V, stride_row, BLOCK)
    z = z.to(tl.float32)
    scale = tl.load(scale_ptr + row)
    keep = (z >= tl.load(floor_ptr + row)) & (z > float("-inf"))  # -inf (and past the row) never drawn
    x = tl.where(keep, z * scale, float("-inf"))
    bits, _, _, _ = tl.philox(tl.load(keys_ptr + row), cols, 0, 0, 0)  # the column, not the row: batch-free
    noisy = x - tl.log(-tl.log(tl.uint_to_uniform_float(bits)))  # u = 0 gives -inf: never drawn
    score = tl.where(scale > 0, noisy, z)
    best = tl.max(score, 0)
    column = tl.argmax(score, 0)  # the lowest column on a tie, as torch.argmax for greedy rows
    m, s = _max_and_sum_exp(x)
    base = part_ptr + (row * num_blocks + block) * 5
    tl.store(base, best)
    tl.store(base + 1, column.to(tl.float32))
    tl.store(base + 2, tl.sum(tl.where(cols == block * BLOCK + column, x, 0.0), 0))
    tl.store(base + 3, m)
    tl.store(base + 4, s)


@triton.jit
def _gumbel_finish(
    part_ptr, scale_ptr, tokens_ptr, logprobs_ptr, num_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr
):  # fmt: skip
    """Combine a row's blocks: the best score's token (the lowest block on a tie), and its scaled logit minus
    the log-sum-exp of the kept entries (0 for a greedy row, which is certain)."""
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    ok = b < num_blocks
    base = part_ptr + (row * num_blocks + b) * 5
    best = tl.load(base, mask=ok, other=float("-inf"))
    m = tl.load(base + 3, mask=ok, other=float("-inf"))
    s = tl.load(base + 4, mask=ok, other=0.0)
    winner = tl.argmax(best, 0)
    pick = b == winner
    column = tl.sum(tl.where(pick, tl.load(base + 1, mask=ok, other=0.0), 0.0), 0).to(tl.int64)
    x = tl.sum(tl.where(pick, tl.load(base + 2, mask=ok, other=0.0), 0.0), 0)
    tl.store(tokens_ptr + row, winner.to(tl.int64) * BLOCK + column)
    tl.store(logprobs_ptr + row, tl.where(tl.load(scale_ptr + row) > 0, x - _combined_lse(m, s), 0.0))


def _partials(logits: torch.Tensor, fields: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Rows with unit column stride, their number of blocks, and an empty [R, blocks, fields] for the partials."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    blocks = triton.cdiv(logits.shape[1], BLOCK)
    return logits, blocks, torch.empty(logits.shape[0], blocks, fields, dtype=dtype, device=logits.device)


def gumbel_max(
    logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of logits [R, V] and its log-probability: (int64 [R], float32 [R]).

    Row r draws from softmax(logits[r] * scale[r]) over the entries with logits[r, v] >= floor[r] (float32
    [R], raw logit units: top-k / top-p; -inf keeps all), noise keyed by keys[r] (int64 [R]) alone; a row with
    scale[r] == 0 (float32 [R]) is greedy: the argmax of its logits (lowest index on a tie), log-prob 0."""
    logits, blocks, partials = _partials(logits, 5, torch.float32)
    scale, floor, keys = scale.contiguous(), floor.contiguous(), keys.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _gumbel_partials[(rows, blocks)](
        logits, scale, floor, keys, partials, vocab, logits.stride(0), blocks, BLOCK=BLOCK, num_warps=8
    )
    _gumbel_finish[(rows,)](
        partials, scale, tokens, logprobs, blocks, BLOCK=BLOCK, BLOCKS=max(16, triton.next_power_of_2(blocks))
    )
    return tokens, logprobs


@triton.jit
def _lse_partials(logits_ptr, scale_ptr, floor_ptr, part_ptr, V, stride_row, num_blocks, BLOCK: tl.constexpr):
    """Block `program_id(1)` of row `program_id(0)`: max and sum of exp of logits * scale over the entries at or
    above the row's floor, in float64 (the scale is loaded as float64: a Python float would come as float32)."""
    row, block, _, z = _row_block(logits_ptr, V, stride_row, BLOCK)
    z32 = z.to(tl.float32)
    keep = (z32 >= tl.load(floor_ptr + row)) & (z32 > float("-inf"))
    x = tl.where(keep, z.to(tl.float64) * tl.load(scale_ptr + row), float("-inf"))
    m, s = _max_and_sum_exp(x)
    base = part_ptr + (row * num_blocks + block) * 2
    tl.store(base, m)
    tl.store(base + 1, s)


@triton.jit
def _lse_finish(part_ptr, out_ptr, num_blocks, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    ok = b < num_blocks
    base = part_ptr + (row * num_blocks + b) * 2
    m = tl.load(base, mask=ok, other=float("-inf"))
    s = tl.load(base + 1, mask=ok, other=0.0)
    tl.store(out_ptr + row, _combined_lse(m, s))


def logsumexp_rows(logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """float64 [R]: logsumexp of logits[r, v] * scale[r] (float64 [R]) over the v with logits[r, v] >= floor[r]
    (float32 [R]; -inf keeps all), for logits [R, V] of any float dtype, scaled and summed in float64 (the SMC
    weights' precision); -inf for a row with nothing kept."""
    logits, blocks, partials = _partials(logits, 2, torch.float64)
    scale, floor = scale.contiguous(), floor.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float64, device=logits.device)
    _lse_partials[(rows, blocks)](
        logits, scale, floor, partials, vocab, logits.stride(0), blocks, BLOCK=BLOCK, num_warps=8
    )
    _lse_finish[(rows,)](partials, out, blocks, BLOCKS=max(16, triton.next_power_of_2(blocks)))
    return out


LOWEST = tl.constexpr(-3.4028234663852886e38)  # float32's most negative finite value
TOP_K_BLOCK = 1024  # vocabulary entries per program of gumbel_top_k: a draft tree has few laws, so more programs


@triton.jit
def _gumbel_top_k_partials(
    logq_ptr, keys_ptr, part_ptr, V, stride_row, num_blocks, K: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Block `program_id(1)` of law `program_id(0)`: the K best columns by logq + Gumbel noise (score, column) and
    the K largest logq. An entry without mass (or noise) ranks as float32's lowest value, last but still apart from
    the columns already taken (-inf), so K distinct columns come out of any block of K real columns."""
    row, block, cols, x = _row_block(logq_ptr, V, stride_row, BLOCK)
    x = x.to(tl.float32)
    bits, _, _, _ = tl.philox(tl.load(keys_ptr + row), cols, 0, 0, 0)  # the column, not the row: as gumbel_max
    noisy = x - tl.log(-tl.log(tl.uint_to_uniform_float(bits)))
    real = cols < V
    score = tl.where(real, tl.maximum(noisy, LOWEST), float("-inf"))
    value = tl.where(real, tl.maximum(x, LOWEST), float("-inf"))
    index = tl.arange(0, BLOCK)
    base = part_ptr + (row * num_blocks + block) * 3 * K
    for j in tl.static_range(K):
        best = tl.argmax(score, 0)
        tl.store(base + j, tl.max(score, 0))
        tl.store(base + K + j, (block * BLOCK + best).to(tl.float32))  # exact: columns < 2^24
        score = tl.where(index == best, float("-inf"), score)
        top = tl.argmax(value, 0)
        tl.store(base + 2 * K + j, tl.max(value, 0))
        value = tl.where(index == top, float("-inf"), value)


@triton.jit
def _gumbel_top_k_finish(part_ptr, tokens_ptr, slots_ptr, entries, K: tl.constexpr, ENTRIES: tl.constexpr):
    """Merge a law's blocks: its K children in draw order (best score first) and its K largest logq, descending
    (float32's lowest back to -inf)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, ENTRIES)
    ok = i < entries
    at = part_ptr + row * 3 * entries + (i // K) * 3 * K + i % K
    score = tl.load(at, mask=ok, other=float("-inf"))
    column = tl.load(at + K, mask=ok, other=0.0)
    value = tl.load(at + 2 * K, mask=ok, other=float("-inf"))
    for j in tl.static_range(K):
        best = tl.argmax(score, 0)
        tl.store(tokens_ptr + row * K + j, tl.sum(tl.where(i == best, column, 0.0), 0).to(tl.int64))
        score = tl.where(i == best, float("-inf"), score)
        top = tl.max(value, 0)
        tl.store(slots_ptr + row * K + j, tl.where(top <= LOWEST, float("-inf"), top))
        value = tl.where(i == tl.argmax(value, 0), float("-inf"), value)


def gumbel_top_k(logq: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from each law exp(logq) [..., V] (Gumbel-top-k, in draw order; noise keyed by
    keys [...] alone) and the k largest logq, descending: (int64 [..., k], float32 [..., k]).

    Two kernels where torch takes the noise's ~15 elementwise passes over [..., V] and two radix top-k's: the
    children of each depth of a drawn draft tree (`TritonBackend.draw_children`)."""
    shape, vocab_size = logq.shape[:-1], logq.shape[-1]
    laws = logq.reshape(-1, vocab_size)
    if laws.stride(1) != 1:
        laws = laws.contiguous()
    rows, blocks = laws.shape[0], triton.cdiv(vocab_size, TOP_K_BLOCK)
    partials = torch.empty(rows, blocks, 3 * k, dtype=torch.float32, device=logq.device)
    tokens = torch.empty(rows, k, dtype=torch.int64, device=logq.device)
    slots = torch.empty(rows, k, dtype=torch.float32, device=logq.device)
    _gumbel_top_k_partials[(rows, blocks)](
        laws, keys.reshape(-1).contiguous(), partials, vocab_size, laws.stride(0), blocks, K=k, BLOCK=TOP_K_BLOCK,
        num_warps=4,
    )  # fmt: skip
    entries = blocks * k
    _gumbel_top_k_finish[(rows,)](
        partials, tokens, slots, entries, K=k, ENTRIES=max(16, triton.next_power_of_2(entries))
    )
    return tokens.view(*shape, k), slots.view(*shape, k)
