"""`smc` level: SMC speculative decoding against a target model (DESIGN.md §3), top of a stack.

A request is a group of N particles (rows). The target prefills the prompt once, draws x0 from
softmax(α·ℓ/T_t), and the prompt KV fans out to all particles by refcount. Each cycle the level
below proposes K tokens per particle, ONE target forward scores [seed, d_1..d_K], the bonus is
drawn from softmax(α·L_K/T_t), log-weights (float64) grow by `weight_increments`, and a group
whose ESS falls under τ·N is resampled (systematic by default): every level forks its row state
dst ← src (block tables and refcounts, no KV bytes). When all particles of a group have finished
(stop token or max_new_tokens) one is returned, drawn ∝ exp(logw) (or the argmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hsmc.engine.host_io import read_counters, upload
from hsmc.engine.sampler import gumbel_noise, sample
from hsmc.levels.base import Level, SequenceState
from hsmc.smc.resampling import multinomial_ancestors, select_particle, systematic_ancestors
from hsmc.smc.weights import effective_sample_size, weight_increments
from hsmc.stopping import StopCriteria


@dataclass(frozen=True)
class SMCParams:
    particles: int
    block_size: int
    alpha: float
    temperature: float
    ess_threshold: float
    resampling: str
    selection: str


@dataclass
class GroupResult:
    token_ids: list[int]
    finish_reason: str
    log_weights: list[float]  # of every particle at the end (since the last resampling)


class SMCLevel:
    step_growth = 0  # not a streaming top: `run` drives its own cycles

    def __init__(self, state: SequenceState, proposal: Level, params: SMCParams, generator: torch.Generator) -> None:
        self.state = state
        self.proposal = proposal
        self.params = params
        self.generator = generator
        self.cycles = 0
        self.resamples = 0
        self.ess_sum = torch.zeros((), dtype=torch.float64, device=state.seq.device)

    def reset_stats(self) -> None:
        self.state.timer.reset()
        self.cycles = self.resamples = 0
        self.ess_sum.zero_()

    def stats(self) -> dict[str, float]:
        group_cycles = max(self.cycles, 1)
        return {
            "mean_ess_fraction": read_counters(self.ess_sum)[0] / group_cycles,
            "resample_rate": self.resamples / group_cycles,
            "forward_seconds": self.state.timer.seconds(),
        }

    def set_len_bound(self, bound: int) -> None:
        self.state.bound_lengths(bound)
        self.proposal.set_len_bound(bound)

    def _levels_release(self, rows: list[int]) -> None:
        index = self._index(rows)
        self.state.release(index)
        self.proposal.release(index)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return upload(torch.tensor(rows, dtype=torch.int64), self.state.seq.device)

    def run(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop: StopCriteria,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[GroupResult]:
        """Decode one wave: prompt g uses rows g*N .. g*N+N-1."""
        p = self.params
        n, k = p.particles, p.block_size
        device = self.state.seq.device
        groups = len(prompts)
        row_of = [[g * n + i for i in range(n)] for g in range(groups)]  # host-side row ids
        first = self._index([r[0] for r in row_of])
        self.state.load_prompts(first, prompts)
        self.proposal.load_prompts(first, prompts)
        self.set_len_bound(max(len(q) for q in prompts))
        # prefill: the target sees the whole prompt and draws x0; the proposal keeps its last token pending
        x0, _ = sample(p.alpha * self.state.forward(first, last_only=True).logits[:, 0], p.temperature, self.generator)
        prompt_len = self.state.seq_len[first]
        self.state.append(first, x0[:, None])
        self.proposal.prefill(first)
        self.proposal.accept(first, prompt_len, x0)
        if n > 1:
            src = self._index([r[0] for r in row_of for _ in range(n - 1)])
            dst = self._index([x for r in row_of for x in r[1:]])
            self.state.fork(src, dst)
            self.proposal.fork(src, dst)

        tokens = [[[t] for _ in range(n)] for t in x0.tolist()]  # [group][particle] generated ids
        stopped = [stop.first_stop([t], 0) is not None for t in x0.tolist()]
        finished = [[s or max_new_tokens <= 1 for _ in range(n)] for s in stopped]
        reason = [["stop" if s else "length" for _ in range(n)] for s in stopped]
        logw = torch.zeros(groups, n, dtype=torch.float64, device=device)
        eos = torch.tensor(sorted(stop.token_ids), dtype=torch.int64, device=device)
        done_groups: set[int] = set()
        self._release_finished(row_of, finished, range(groups))
        try:
            while True:
                for g in range(groups):
                    if g not in done_groups and all(finished[g]):
                        done_groups.add(g)
                        if on_finish:
                            on_finish(g)
                active = [(g, i) for g in range(groups) for i in range(n) if not finished[g][i]]
                if not active:
                    break
                act = self._index([row_of[g][i] for g, i in active])
                delta, new_tokens = self._cycle(act, k, eos)
                logw.view(-1)[act] += delta  # row g*N+i is logw[g, i]
                for (g, i), toks in zip(active, new_tokens):
                    before = len(tokens[g][i])
                    tokens[g][i] += toks[: max_new_tokens - before]
                    cut = stop.first_stop(tokens[g][i], before)
                    if cut is not None:
                        del tokens[g][i][cut:]
                        finished[g][i], reason[g][i] = True, "stop"
                    elif len(tokens[g][i]) == max_new_tokens:
                        finished[g][i], reason[g][i] = True, "length"
                live = sorted({g for g, _ in active})
                self._release_finished(row_of, finished, live)
                self._maybe_resample(live, row_of, logw, tokens, finished, reason)
            gumbel = gumbel_noise(logw.shape, self.generator, device).double()
            chosen = select_particle(logw, p.selection, gumbel).tolist()
            weights = logw.tolist()
            return [GroupResult(tokens[g][c], reason[g][c], weights[g]) for g, c in enumerate(chosen)]
        finally:
            self._levels_release([x for r in row_of for x in r])

    def _cycle(self, rows: torch.Tensor, k: int, eos: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
        """One SMC cycle for active particle rows: weight increments (EOS-masked) and the K+1 new tokens
        (read to the host in one copy)."""
        p = self.params
        base = self.state.seq_len[rows]  # seq ends with the seed (last bonus / x0)
        if k:
            prop = self.proposal.propose(rows, k)
            draft, logq = prop.tokens, prop.logq
            self.state.append(rows, draft)
        else:
            draft = torch.zeros(len(rows), 0, dtype=torch.int64, device=rows.device)
            logq = torch.zeros(len(rows), 0, device=rows.device)
        target = self.state.forward(rows).last(k + 1).float()  # L_0..L_K
        bonus, _ = sample(p.alpha * target[:, k], p.temperature, self.generator)
        no = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
        delta = weight_increments(target, draft, logq, bonus, no, eos, p.alpha, p.temperature)
        keep_len = base + k
        self.state.truncate(rows, keep_len, bonus, max_drop=k + 1)
        if k:
            self.proposal.accept(rows, keep_len, bonus)
        return delta, torch.cat([draft, bonus[:, None]], 1).tolist()

    def _release_finished(self, row_of: list[list[int]], finished: list[list[bool]], groups) -> None:
        """Finished particles keep their tokens and weight but need no KV (releasing twice is harmless)."""
        done = [row_of[g][i] for g in groups for i, f in enumerate(finished[g]) if f]
        if done:
            self._levels_release(done)

    def _maybe_resample(
        self,
        live: list[int],
        row_of: list[list[int]],
        logw: torch.Tensor,
        tokens: list[list[list[int]]],
        finished: list[list[bool]],
        reason: list[list[str]],
    ) -> None:
        """Resample the live groups whose ESS fell under τ·N; host lists are updated in place."""
        p = self.params
        n = p.particles
        if not live:
            return
        ess = effective_sample_size(logw[live])
        self.cycles += len(live)
        self.ess_sum += (ess / n).sum()
        if n < 2 or p.ess_threshold <= 0:
            return
        low = [g for g, e in zip(live, ess.tolist()) if e < p.ess_threshold * n]
        if not low:
            return
        self.resamples += len(low)
        if p.resampling == "systematic":
            u = torch.rand(len(low), generator=self.generator, device=logw.device, dtype=torch.float64)
            ancestors = systematic_ancestors(logw[low], u)
        else:
            u = torch.rand(len(low), n, generator=self.generator, device=logw.device, dtype=torch.float64)
            ancestors = multinomial_ancestors(logw[low], u)
        fork_src, fork_dst, dead = [], [], []
        for g, anc in zip(low, ancestors.tolist()):
            snap = [(list(tokens[g][a]), finished[g][a], reason[g][a]) for a in anc]
            for i, a in enumerate(anc):
                if a == i:
                    continue
                if finished[g][a]:
                    if not finished[g][i]:
                        dead.append(row_of[g][i])
                else:
                    fork_src.append(row_of[g][a])
                    fork_dst.append(row_of[g][i])
            for i, (toks, fin, why) in enumerate(snap):
                tokens[g][i], finished[g][i], reason[g][i] = toks, fin, why
            logw[g] = 0
        if fork_src:
            src, dst = self._index(fork_src), self._index(fork_dst)
            self.state.fork(src, dst)
            self.proposal.fork(src, dst)
        if dead:
            self._levels_release(dead)
