"""A Triton matrix-vector product for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 16 rows.

At decode a linear layer is a pass over its weight matrix and nothing else; the kernel streams each
program's [BLOCK_N, K] slab of W once with wide, coalesced loads (K is contiguous), multiplies it into
all M rows at once on the tensor cores (M padded to 16), and accumulates in fp32. When N alone gives
too few programs to keep every SM streaming, K is split and the partial sums are added atomically
into an fp32 buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_valid = n < N
    m_valid = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < k_hi
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    mask = m_valid[:, None] & n_valid[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, sm_count: int, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """x [..., K] (at most 16 rows in all) @ weight[N, K]^T -> [..., N] in x's dtype."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    programs = triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(2 * sm_count, programs), k // (4 * block_k)))
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    if splits > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(programs, splits)](
        x2, weight, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0), per_split,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=splits > 1, num_warps=4, num_stages=4,
    )  # fmt: skip
    return out.to(x.dtype).view(*x.shape[:-1], n)
