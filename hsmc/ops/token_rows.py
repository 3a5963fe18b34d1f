"""A forward's pending tokens read from the rows' sequences, and a step's tokens appended to them: one kernel each
on CUDA (`TritonBackend.pending_tokens` / `append_tokens`; `TorchBackend`'s torch ops are the reference), instead of
about twenty tiny torch kernels per forward on the serial chain of a graphed cycle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def row_tiles(rows: int, width: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) of a one-program kernel over [rows, width]: every row in one tile, at most 4096 entries."""
    block_r = triton.next_power_of_2(max(rows, 1))
    return block_r, min(triton.next_power_of_2(max(width, 1)), max(1, 4096 // block_r))


@triton.jit
def _pending_kernel(
    seq_ptr,
    seq_len_ptr,
    kv_len_ptr,
    rows_ptr,
    start_ptr,
    count_ptr,
    tokens_ptr,
    R,
    width,
    leave,
    capacity,
    stride_seq,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    row = tl.load(rows_ptr + r, mask=r_ok, other=0)
    start = tl.load(kv_len_ptr + row, mask=r_ok, other=0)
    count = tl.maximum(tl.load(seq_len_ptr + row, mask=r_ok, other=0) - leave - start, 0)
    tl.store(start_ptr + r, start, mask=r_ok)
    tl.store(count_ptr + r, count, mask=r_ok)
    for w0 in range(0, width, BLOCK_W):
        j = w0 + tl.arange(0, BLOCK_W)
        out = r_ok[:, None] & (j < width)[None, :]
        col = tl.minimum(tl.maximum(start[:, None] + j[None, :], 0), capacity)
        token = tl.load(seq_ptr + row[:, None] * stride_seq + col, mask=out & (j[None, :] < count[:, None]), other=0)
        tl.store(tokens_ptr + r[:, None] * width + j[None, :], token, mask=out)


@triton.jit
def _append_kernel(
    seq_ptr,
    seq_len_ptr,
    rows_ptr,
    tokens_ptr,
    R,
    m,
    capacity,
    stride_seq,
    stride_tr,
    stride_tm,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    row = tl.load(rows_ptr + r, mask=r_ok, other=0)
    length = tl.load(seq_len_ptr + row, mask=r_ok, other=0)
    for w0 in range(0, m, BLOCK_W):
        j = w0 + tl.arange(0, BLOCK_W)
        ok = r_ok[:, None] & (j < m)[None, :]
        token = tl.load(tokens_ptr + r[:, None] * stride_tr + j[None, :] * stride_tm, mask=ok)
        col = tl.minimum(length[:, None] + j[None, :], capacity)
        tl.store(seq_ptr + row[:, None] * stride_seq + col, token, mask=ok)
    tl.store(seq_len_ptr + row, length + m, mask=r_ok)


def pending_tokens(
    seq: torch.Tensor, seq_len: torch.Tensor, kv_len: torch.Tensor, rows: torch.Tensor, leave: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's KV length (`start`), its tokens past it but the last `leave` (`count`, at least 0), and those
    tokens padded with 0 to `width` (columns clamped to the sequence's capacity): (start, count, tokens [R, width])."""
    r = rows.shape[0]
    start = torch.empty(r, dtype=torch.int64, device=seq.device)
    count = torch.empty(r, dtype=torch.int64, device=seq.device)
    tokens = torch.empty(r, max(width, 1), dtype=seq.dtype, device=seq.device)[:, :width]  # never a null pointer
    if r == 0:
        return start, count, tokens
    block_r, block_w = row_tiles(r, width)
    _pending_kernel[(1,)](
        seq, seq_len, kv_len, rows, start, count, tokens, r, width, leave, seq.shape[1] - 1, seq.stride(0),
        BLOCK_R=block_r, BLOCK_W=block_w,
    )  # fmt: skip
    return start, count, tokens


def append_tokens(seq: torch.Tensor, seq_len: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """seq[row, seq_len[row] + j] = tokens[i, j] (columns clamped to the capacity), seq_len[row] += m."""
    r, m = tokens.shape
    if r == 0 or m == 0:
        return
    block_r, block_w = row_tiles(r, m)
    _append_kernel[(1,)](
        seq, seq_len, rows, tokens, r, m, seq.shape[1] - 1, seq.stride(0), tokens.stride(0), tokens.stride(1),
        BLOCK_R=block_r, BLOCK_W=block_w,
    )  # fmt: skip
