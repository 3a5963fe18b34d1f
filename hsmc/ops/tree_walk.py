"""The walk of a draft tree's verification (`TritonBackend.tree_walk`; `hsmc.speculative.tree_verify` is the
reference) in a few kernels instead of hundreds.

The reference tests one child per step over whole-vocabulary tensors: for a 33-node tree over Qwen3's 151,936 tokens
its walk took 1.7 ms (draft_aware) and 15 ms (traversal) on an H200, against 5.9 ms for the verify forward itself
(docs/measurements/2026-11-30-h200-tree-walk.txt). But the residual at a node after its first t children were tried
has a closed form: with the node's entry weight w (1 except under traversal), ρ_t = max(w·p − T_t·q, 0) except at the
tried children's tokens, which keep the value they had when that child was rejected; Z_t = Σ ρ_t; r_t = ρ_t / Z_t.
Rejecting child t + 1 (token x, q's mass c_t left) sets T_{t+1} = T_t + M_t / c_t and c_{t+1} = c_t − q(x), with
M_t = Z_t (draft_aware) or Z_t + 1 − w (traversal: its "stop" mass). None of this depends on the uniforms, so:

- one prep kernel per row: each node's rank among its siblings, its children, p and q at its token, and under
  traversal the pass at which its entry weight is known;
- passes over (row, node, vocabulary block): pass s evaluates Σ max(w·p − T·q, 0) for every node whose next
  state is due (draft_aware: all nodes at once, one pass per child rank; traversal: a node's states follow its
  parent's, at most N − 1 passes);
- one walk kernel per row that only reads these scalars (the uniforms decide where it stops), and one kernel that
  writes the normalised residual at the node it stopped at.

target_only (children without q) needs no pass: ρ_t is p with the tried children's tokens zeroed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCKS = 32  # vocabulary blocks per node in a pass (Qwen3's 151,936 entries: 32 of 5,120, the last 2 empty)
BLOCK_V = 1024
TINY = tl.constexpr(1e-30)


@triton.jit
def _row_nodes(parent_ptr, rank_ptr, px_ptr, qx_ptr, fresh_ptr, row, N, BLOCK_N: tl.constexpr):
    """Row `row`'s nodes as vectors: (ids, parent (-1 for the root and past N), rank, p and q at the node's token,
    fresh: the token is not an earlier sibling's)."""
    ids = tl.arange(0, BLOCK_N)
    ok = ids < N
    at = row * N + ids
    par = tl.load(parent_ptr + at, mask=ok, other=-1).to(tl.int32)
    par = tl.where(ids == 0, -1, par)
    rank = tl.load(rank_ptr + at, mask=ok, other=0)
    px = tl.load(px_ptr + at, mask=ok, other=0.0)
    qx = tl.load(qx_ptr + at, mask=ok, other=0.0)
    fresh = tl.load(fresh_ptr + at, mask=ok, other=0)
    return ids, par, rank, px, qx, fresh


@triton.jit
def _total(
    node_at, n, e, w, par, rank, px, qx, fresh, t_ptr, part_ptr, KP1, NB: tl.constexpr, ONE_HOT: tl.constexpr
):  # fmt: skip
    """Z_e of node n (flat index node_at = row * N + n, entry weight w): its pass's partial sums, with the values
    at its first e children's tokens set back to what they were when each was rejected."""
    tried = (par == n) & (rank < e)
    if ONE_HOT:
        z = w - tl.sum(tl.where(tried & (fresh != 0), px, 0.0), 0)
    else:
        blocks = tl.load(part_ptr + (node_at * KP1 + e) * NB + tl.arange(0, NB))
        t_now = tl.load(t_ptr + node_at * KP1 + e)
        t_then = tl.load(t_ptr + node_at * KP1 + rank + 1, mask=tried, other=0.0)
        fix = tl.maximum(w * px - t_then * qx, 0.0) - tl.maximum(w * px - t_now * qx, 0.0)
        z = tl.where(e == 0, w, tl.sum(blocks, 0) + tl.sum(tl.where(tried, fix, 0.0), 0))
    return z


@triton.jit
def _entry_weight(
    row, n, N, ids, par, rank, px, qx, fresh, parent_ptr, t_ptr, c_ptr, part_ptr, KP1, NB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Traversal's weight of node n when entered: min(1, σ(x) / q_t(x)) of its parent's state at n's rank, down
    the path from the root (weight 1)."""
    path = tl.zeros([BLOCK_N], dtype=tl.int32)
    d = tl.zeros([], dtype=tl.int32)
    a = n
    while a != 0:
        path = tl.where(ids == d, a, path)
        a = tl.load(parent_ptr + row * N + a).to(tl.int32)
        d += 1
    w = tl.full([], 1.0, tl.float32)
    for j in range(0, d):
        node = tl.sum(tl.where(ids == d - 1 - j, path, 0), 0)
        here = ids == node
        up = tl.sum(tl.where(here, par, 0), 0)
        r = tl.sum(tl.where(here, rank, 0), 0)
        p_x = tl.sum(tl.where(here, px, 0.0), 0)
        q_x = tl.sum(tl.where(here, qx, 0.0), 0)
        up_at = row * N + up
        z = _total(up_at, up, r, w, par, rank, px, qx, fresh, t_ptr, part_ptr, KP1, NB, False)
        t = tl.load(t_ptr + up_at * KP1 + r)
        c = tl.load(c_ptr + up_at * KP1 + r)
        sigma = tl.maximum(w * p_x - t * q_x, 0.0) / tl.maximum(z + 1.0 - w, TINY)
        w = tl.where(q_x > 0, tl.minimum(sigma * c / tl.maximum(q_x, TINY), 1.0), 0.0)
    return w


@triton.jit
def _prep_kernel(
    parent_ptr, tokens_ptr, p_ptr, q_ptr, rank_ptr, kids_ptr, start_ptr, px_ptr, qx_ptr, fresh_ptr, t_ptr, c_ptr,
    N, V, KP1, HAS_Q: tl.constexpr, TRAVERSAL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    ids = tl.arange(0, BLOCK_N)
    ok = ids < N
    at = row * N + ids
    par = tl.load(parent_ptr + at, mask=ok, other=-1).to(tl.int32)
    par = tl.where(ids == 0, -1, par)
    tok = tl.load(tokens_ptr + at, mask=ok, other=-1)
    child = (par >= 0) & ok
    # [i, j]: j is an earlier sibling of i
    sibling = child[:, None] & child[None, :] & (par[:, None] == par[None, :]) & (ids[None, :] < ids[:, None])
    rank = tl.sum(sibling.to(tl.int32), 1)
    fresh = tl.sum((sibling & (tok[:, None] == tok[None, :])).to(tl.int32), 1) == 0
    kids = tl.sum(((par[None, :] == ids[:, None]) & child[None, :]).to(tl.int32), 1)
    law_at = (row * N + tl.maximum(par, 0)).to(tl.int64) * V + tl.maximum(tok, 0)
    px = tl.load(p_ptr + law_at, mask=child, other=0.0)
    if HAS_Q:
        qx = tl.where(fresh, tl.load(q_ptr + law_at, mask=child, other=0.0), 0.0)
    else:
        qx = tl.where(child, 1.0, 0.0)
    start = tl.zeros([BLOCK_N], dtype=tl.int32)
    if TRAVERSAL:  # a node's entry weight is known once its parent's state at its rank is: start = Σ ranks on its path
        for m in range(1, N):
            here = ids == m
            up = tl.sum(tl.where(here, par, 0), 0)
            start = tl.where(here, tl.sum(tl.where(ids == up, start, 0), 0) + tl.sum(tl.where(here, rank, 0), 0), start)
    tl.store(rank_ptr + at, rank, mask=ok)
    tl.store(kids_ptr + at, kids, mask=ok)
    tl.store(start_ptr + at, start, mask=ok)
    tl.store(px_ptr + at, px, mask=ok)
    tl.store(qx_ptr + at, qx, mask=ok)
    tl.store(fresh_ptr + at, fresh.to(tl.int32), mask=ok)
    tl.store(t_ptr + at * KP1, tl.zeros([BLOCK_N], dtype=tl.float32), mask=ok)
    tl.store(c_ptr + at * KP1, tl.full([BLOCK_N], 1.0, tl.float32), mask=ok)


@triton.jit
def _pass_kernel(
    p_ptr, q_ptr, parent_ptr, rank_ptr, kids_ptr, start_ptr, px_ptr, qx_ptr, fresh_ptr, t_ptr, c_ptr, part_ptr,
    step, N, V, KP1, CHUNK, NB: tl.constexpr, TRAVERSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Pass `step` for node program_id(0) (row * N + node), vocabulary block program_id(1): if the node's state
    e = step − start is due (1 <= e <= its children), T_e and c_e (stored by block 0) and this block's
    Σ max(w·p − T_e·q, 0)."""
    node_at = tl.program_id(0)
    block = tl.program_id(1)
    row = node_at // N
    n = node_at % N
    e = step - tl.load(start_ptr + node_at)
    if (e >= 1) & (e <= tl.load(kids_ptr + node_at)):
        ids, par, rank, px, qx, fresh = _row_nodes(parent_ptr, rank_ptr, px_ptr, qx_ptr, fresh_ptr, row, N, BLOCK_N)
        if TRAVERSAL:
            w = _entry_weight(
                row, n, N, ids, par, rank, px, qx, fresh, parent_ptr, t_ptr, c_ptr, part_ptr, KP1, NB, BLOCK_N
            )
        else:
            w = tl.full([], 1.0, tl.float32)
        q_x = tl.sum(tl.where((par == n) & (rank == e - 1), qx, 0.0), 0)  # the child tried last
        t = tl.load(t_ptr + node_at * KP1 + e - 1)
        c = tl.load(c_ptr + node_at * KP1 + e - 1)
        z = _total(node_at, n, e - 1, w, par, rank, px, qx, fresh, t_ptr, part_ptr, KP1, NB, False)
        if TRAVERSAL:
            z = z + 1.0 - w  # the stop mass
        t = t + tl.where(q_x > 0, z / tl.maximum(c, TINY), 0.0)
        if block == 0:
            tl.store(t_ptr + node_at * KP1 + e, t)
            tl.store(c_ptr + node_at * KP1 + e, c - q_x)
        lo = block * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        base = node_at.to(tl.int64) * V
        for v0 in range(lo, hi, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            inside = cols < hi
            p = tl.load(p_ptr + base + cols, mask=inside, other=0.0)
            q = tl.load(q_ptr + base + cols, mask=inside, other=0.0)
            acc += tl.maximum(w * p - t * q, 0.0)
        tl.store(part_ptr + (node_at * KP1 + e) * NB + block, tl.sum(acc, 0))


@triton.jit
def _walk_kernel(
    parent_ptr, rank_ptr, kids_ptr, px_ptr, qx_ptr, fresh_ptr, u_ptr, t_ptr, c_ptr, part_ptr, node_ptr, end_ptr,
    N, KP1, NB: tl.constexpr, ONE_HOT: tl.constexpr, TRAVERSAL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Row program_id(0)'s walk over the precomputed states: the node it stops at, and (state, T, Z, w) there."""
    row = tl.program_id(0)
    ids, par, rank, px, qx, fresh = _row_nodes(parent_ptr, rank_ptr, px_ptr, qx_ptr, fresh_ptr, row, N, BLOCK_N)
    u = tl.load(u_ptr + row * N + ids, mask=ids < N, other=1.0)
    cur = tl.zeros([], dtype=tl.int32)
    if TRAVERSAL:  # depth first; a node without untried children is kept with its weight
        tried = tl.zeros([BLOCK_N], dtype=tl.int32)
        weight = tl.where(ids == 0, 1.0, 0.0)
        done = tl.zeros([], dtype=tl.int32)
        while done == 0:
            here = ids == cur
            at = row * N + cur
            e = tl.sum(tl.where(here, tried, 0), 0)
            w = tl.sum(tl.where(here, weight, 0.0), 0)
            z = _total(at, cur, e, w, par, rank, px, qx, fresh, t_ptr, part_ptr, KP1, NB, False)
            if e < tl.load(kids_ptr + at):
                child = (par == cur) & (rank == e)
                m = tl.sum(tl.where(child, ids, 0), 0)
                p_x = tl.sum(tl.where(child, px, 0.0), 0)
                q_x = tl.sum(tl.where(child, qx, 0.0), 0)
                t = tl.load(t_ptr + at * KP1 + e)
                c = tl.load(c_ptr + at * KP1 + e)
                sigma = tl.maximum(w * p_x - t * q_x, 0.0) / tl.maximum(z + 1.0 - w, TINY)
                entered = tl.minimum(sigma * c / tl.maximum(q_x, TINY), 1.0)
                enter = q_x > 0  # else the drafter had no mass left for x: not drawn, skipped
                weight = tl.where(ids == m, tl.where(enter, entered, weight), weight)
                tried = tl.where(here, tl.where(enter, tried, e + 1), tried)
                cur = tl.where(enter, m, cur)
            else:
                kept = (tl.sum(tl.where(here, u, 0.0), 0) < z / tl.maximum(z + 1.0 - w, TINY)) | (cur == 0)
                up = tl.sum(tl.where(here, tl.maximum(par, 0), 0), 0)
                tried = tl.where(ids == up, tl.where(kept, tried, tl.sum(tl.where(here, rank, 0), 0) + 1), tried)
                done = kept.to(tl.int32)
                cur = tl.where(kept, cur, up)
        e = tl.sum(tl.where(ids == cur, tried, 0), 0)
        w = tl.sum(tl.where(ids == cur, weight, 0.0), 0)
    else:  # children in order; a kept child becomes the current node
        e = tl.zeros([], dtype=tl.int32)
        for m in range(1, N):
            here = ids == m
            if tl.sum(tl.where(here, par, 0), 0) == cur:
                at = row * N + cur
                z = _total(at, cur, e, 1.0, par, rank, px, qx, fresh, t_ptr, part_ptr, KP1, NB, ONE_HOT)
                z = tl.maximum(z, TINY)
                p_x = tl.sum(tl.where(here, px, 0.0), 0)
                q_x = tl.sum(tl.where(here, qx, 0.0), 0)
                u_m = tl.sum(tl.where(here, u, 0.0), 0)
                if ONE_HOT:
                    kept = u_m * z < tl.where(tl.sum(tl.where(here, fresh, 0), 0) != 0, p_x, 0.0)
                else:
                    t = tl.load(t_ptr + at * KP1 + e)
                    c = tl.load(c_ptr + at * KP1 + e)
                    kept = (q_x > 0) & (u_m * q_x / tl.maximum(c, TINY) < tl.maximum(p_x - t * q_x, 0.0) / z)
                cur = tl.where(kept, m, cur)
                e = tl.where(kept, 0, tl.sum(tl.where(here, rank, 0), 0) + 1)
        w = tl.full([], 1.0, tl.float32)
    at = row * N + cur
    z = _total(at, cur, e, w, par, rank, px, qx, fresh, t_ptr, part_ptr, KP1, NB, ONE_HOT)
    tl.store(node_ptr + row, cur.to(tl.int64))
    tl.store(end_ptr + row * 4, e.to(tl.float32))
    if not ONE_HOT:
        tl.store(end_ptr + row * 4 + 1, tl.load(t_ptr + at * KP1 + e))
    tl.store(end_ptr + row * 4 + 2, z)
    tl.store(end_ptr + row * 4 + 3, w)


@triton.jit
def _residual_kernel(
    p_ptr, q_ptr, parent_ptr, tokens_ptr, rank_ptr, px_ptr, qx_ptr, fresh_ptr, t_ptr, node_ptr, end_ptr, out_ptr,
    N, V, KP1, CHUNK, ONE_HOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Block program_id(1) of row program_id(0)'s normalised residual ρ_e / Z_e at the node the walk stopped at."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    n = tl.load(node_ptr + row).to(tl.int32)
    e = tl.load(end_ptr + row * 4).to(tl.int32)
    t = tl.load(end_ptr + row * 4 + 1)
    inv = 1.0 / tl.maximum(tl.load(end_ptr + row * 4 + 2), TINY)
    w = tl.load(end_ptr + row * 4 + 3)
    node_at = row * N + n
    base = node_at.to(tl.int64) * V
    lo = block * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        inside = cols < hi
        p = tl.load(p_ptr + base + cols, mask=inside, other=0.0)
        if ONE_HOT:
            rho = p
        else:
            rho = tl.maximum(w * p - t * tl.load(q_ptr + base + cols, mask=inside, other=0.0), 0.0)
        tl.store(out_ptr + row.to(tl.int64) * V + cols, rho * inv, mask=inside)
    tl.debug_barrier()  # the tried children's tokens below overwrite this program's stores
    ids, par, rank, px, qx, fresh = _row_nodes(parent_ptr, rank_ptr, px_ptr, qx_ptr, fresh_ptr, row, N, BLOCK_N)
    tok = tl.load(tokens_ptr + row * N + ids, mask=ids < N, other=-1)
    tried = (par == n) & (rank < e) & (fresh != 0) & (tok >= lo) & (tok < hi)
    if ONE_HOT:
        frozen = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        t_then = tl.load(t_ptr + node_at * KP1 + rank + 1, mask=tried, other=0.0)
        frozen = tl.maximum(w * px - t_then * qx, 0.0) * inv
    tl.store(out_ptr + row.to(tl.int64) * V + tok, frozen, mask=tried)


def tree_walk(
    rule: str,
    parent: torch.Tensor,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    u: torch.Tensor,
    max_children: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_tree` (`rule` target_only with q None, draft_aware) or `verify_tree_traversal` (`rule` traversal):
    the node each row's walk ends at [R] and the normalised law of the token after it [R, V]. No node may have
    more than `max_children` children (the tree shape's top-k): draft_aware runs one pass per child rank."""
    rows, n_nodes = tokens.shape
    vocab = p.shape[-1]
    traversal = rule == "traversal"
    one_hot = q is None
    passes = 0 if one_hot else n_nodes - 1 if traversal else min(max_children, n_nodes - 1)
    kp1 = passes + 1
    device = p.device
    p = p.float().contiguous()
    q = p if one_hot else q.float().contiguous()
    parent, tokens, u = parent.contiguous(), tokens.contiguous(), u.float().contiguous()
    block_n = max(16, triton.next_power_of_2(n_nodes))
    blocks = min(MAX_BLOCKS, triton.next_power_of_2(triton.cdiv(vocab, 4 * BLOCK_V)))
    chunk = triton.cdiv(triton.cdiv(vocab, blocks), BLOCK_V) * BLOCK_V
    rank, kids, start, fresh = torch.empty(4, rows, n_nodes, dtype=torch.int32, device=device)
    px, qx = torch.empty(2, rows, n_nodes, device=device)
    t = torch.empty(rows, n_nodes, kp1, device=device)
    c = torch.empty_like(t)
    part = torch.empty(rows, n_nodes, kp1, blocks, device=device)
    node = torch.empty(rows, dtype=torch.int64, device=device)
    end = torch.empty(rows, 4, device=device)
    out = torch.empty(rows, vocab, device=device)
    _prep_kernel[(rows,)](
        parent, tokens, p, q, rank, kids, start, px, qx, fresh, t, c, n_nodes, vocab, kp1,
        HAS_Q=not one_hot, TRAVERSAL=traversal, BLOCK_N=block_n,
    )  # fmt: skip
    for step in range(1, passes + 1):
        _pass_kernel[(rows * n_nodes, blocks)](
            p, q, parent, rank, kids, start, px, qx, fresh, t, c, part, step, n_nodes, vocab, kp1, chunk,
            NB=blocks, TRAVERSAL=traversal, BLOCK_N=block_n, BLOCK_V=BLOCK_V,
        )  # fmt: skip
    _walk_kernel[(rows,)](
        parent, rank, kids, px, qx, fresh, u, t, c, part, node, end, n_nodes, kp1,
        NB=blocks, ONE_HOT=one_hot, TRAVERSAL=traversal, BLOCK_N=block_n,
    )  # fmt: skip
    _residual_kernel[(rows, blocks)](
        p, q, parent, tokens, rank, px, qx, fresh, t, node, end, out, n_nodes, vocab, kp1, chunk,
        ONE_HOT=one_hot, BLOCK_N=block_n, BLOCK_V=BLOCK_V,
    )  # fmt: skip
    return node, out
