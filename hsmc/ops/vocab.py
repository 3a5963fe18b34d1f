"""Reductions over a row of logits in one pass: a Gumbel-max draw with its log-probability, and log-normalizers.

A sampling step or an SMC weight reads each row of logits (152k values for Qwen3) a few times in torch -- a
float copy, the scaling, uniform noise and its two logarithms, the argmax, a log-softmax, a gather: about
fourteen kernels over [rows, vocabulary] per draw, each a separate launch on the chain of a graphed cycle. Here
the row is read once: programs reduce blocks of it to partial results (the best noisy score, its token and
logit, the block's max and sum of exponentials), and one small kernel per row combines them. The noise is
Philox, counter (column, row), keyed by a seed drawn from the caller's torch generator on the device, so a draw
is reproducible from the generator's seed, needs no host read and can be captured in a CUDA graph. The torch
path (`hsmc.engine.sampler`, `hsmc.smc.weights`) stays the CPU reference; these kernels run on CUDA and, through
Triton's interpreter, in the tests (whose chi-square checks hold them to the exact law).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per program


@triton.jit
def _scaled_block(logits_ptr, V, stride_row, scale, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """Block `program_id(1)` of row `program_id(0)` times `scale` in `dtype`, -inf past the row:
    (row, block, columns, in range, values)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=float("-inf")).to(dtype)
    return row, block, cols, ok, x * scale


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
    logits_ptr, seed_ptr, part_ptr, V, stride_row, inv_temperature, num_blocks, BLOCK: tl.constexpr
):  # fmt: skip
    """Block `program_id(1)` of row `program_id(0)`: (best score, its column, its scaled logit, max, sum exp)."""
    row, block, cols, ok, x = _scaled_block(logits_ptr, V, stride_row, inv_temperature, tl.float32, BLOCK)
    bits, _, _, _ = tl.philox(tl.load(seed_ptr), cols, row, 0, 0)
    uniform = tl.uint_to_uniform_float(bits)
    score = tl.where(ok, x - tl.log(-tl.log(uniform)), float("-inf"))  # u = 0 gives -inf: never drawn
    best = tl.max(score, 0)
    column = tl.argmax(score, 0)
    m, s = _max_and_sum_exp(x)
    base = part_ptr + (row * num_blocks + block) * 5
    tl.store(base, best)
    tl.store(base + 1, column.to(tl.float32))
    tl.store(base + 2, tl.sum(tl.where(cols == block * BLOCK + column, x, 0.0), 0))
    tl.store(base + 3, m)
    tl.store(base + 4, s)


@triton.jit
def _gumbel_finish(part_ptr, tokens_ptr, logprobs_ptr, num_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """Combine a row's blocks: the best score's token (the lowest block on a tie), and its scaled logit minus
    the row's log-sum-exp."""
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
    tl.store(logprobs_ptr + row, x - _combined_lse(m, s))


def _partials(logits: torch.Tensor, fields: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Rows with unit column stride, their number of blocks, and an empty [R, blocks, fields] for the partials."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    blocks = triton.cdiv(logits.shape[1], BLOCK)
    return logits, blocks, torch.empty(logits.shape[0], blocks, fields, dtype=dtype, device=logits.device)


def gumbel_max(logits: torch.Tensor, temperature: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of logits [R, V] from softmax(logits / temperature) (> 0) and its log-probability,
    noise keyed by `seed` (int64 [1] on the logits' device): (int64 [R], float32 [R])."""
    logits, blocks, partials = _partials(logits, 5, torch.float32)
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _gumbel_partials[(rows, blocks)](
        logits, seed, partials, vocab, logits.stride(0), 1.0 / temperature, blocks, BLOCK=BLOCK, num_warps=8
    )
    _gumbel_finish[(rows,)](
        partials, tokens, logprobs, blocks, BLOCK=BLOCK, BLOCKS=max(16, triton.next_power_of_2(blocks))
    )
    return tokens, logprobs


@triton.jit
def _lse_partials(logits_ptr, part_ptr, V, stride_row, scale_hi, scale_lo, num_blocks, BLOCK: tl.constexpr):
    """Block `program_id(1)` of row `program_id(0)`: max and sum of exp of logits * scale, in float64; the scale
    comes as two float32 parts (Triton passes a Python float as float32) whose float64 sum is exact."""
    row, block, _, _, x = _scaled_block(logits_ptr, V, stride_row, 1.0, tl.float64, BLOCK)
    x = tl.where(x == float("-inf"), x, x * scale_hi + x * scale_lo)  # (-inf) * (hi + lo) stays -inf
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


def logsumexp_rows(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 [R]: logsumexp(logits[r] * scale) for logits [R, V] of any float dtype, scaled and summed in
    float64 (the SMC weights' precision)."""
    logits, blocks, partials = _partials(logits, 2, torch.float64)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float64, device=logits.device)
    hi = float(torch.tensor(scale, dtype=torch.float32))
    _lse_partials[(rows, blocks)](
        logits, partials, vocab, logits.stride(0), hi, scale - hi, blocks, BLOCK=BLOCK, num_warps=8
    )
    _lse_finish[(rows,)](partials, out, blocks, BLOCKS=max(16, triton.next_power_of_2(blocks)))
    return out
