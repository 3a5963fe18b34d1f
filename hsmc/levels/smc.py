"""`smc` level: SMC speculative decoding against a target model (DESIGN.md §3), top of a stack.

A request is a group of N particles (rows). The target prefills the prompt once and the prompt KV
fans out to all particles by refcount; each particle draws its own x0 from softmax(α·ℓ/T_t) (one
shared x0 would fix the first token's marginal at the local power, not the global p_T^α), with
the weight term log Σ p_T^α at that position. Each cycle the level below proposes K tokens per
particle, ONE target forward scores [seed, d_1..d_K], the bonus is drawn from softmax(α·L_K/T_t),
and log-weights (float64) grow by `weight_increments` over the tokens that belong to the output:
tokens after the one that ends a particle (stop token, stop string, max_new_tokens) never count.
A group whose ESS falls under τ·N is resampled (systematic by default): every level forks its row
state dst ← src (block tables and refcounts, no KV bytes). When all particles of a group have
finished, one is returned, drawn ∝ exp(logw) (or the argmax), with all N particles, the estimate
log Ẑ (Σ over resampling intervals, the last included, of logsumexp(logw) − log N) and the number
of resamplings.

Host reads per cycle: the new tokens (stop checks need them), then the ESS of the live groups
together with their would-be ancestors; a rejection level below adds its own (see its `propose`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hsmc.engine.host_io import PendingRead, read_counters, upload
from hsmc.engine.sampler import gumbel_noise, sample
from hsmc.levels.base import Level, SequenceState
from hsmc.smc.resampling import multinomial_ancestors, select_particle, systematic_ancestors
from hsmc.smc.weights import effective_sample_size, log_normalizer, weight_increments
from hsmc.stopping import StopCriteria
from hsmc.streaming import WaveEvent, common_prefix_length


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
    """The end state of one request's particle system."""

    particles: list[list[int]]  # every particle's generated ids
    finish_reasons: list[str]
    log_weights: list[float]  # since the last resampling
    log_z: float  # log Ẑ, an unbiased estimate (in exp) of Σ over outputs of p_T(output)^α
    resamplings: int
    chosen: int  # the particle returned

    @property
    def token_ids(self) -> list[int]:
        return self.particles[self.chosen]

    @property
    def finish_reason(self) -> str:
        return self.finish_reasons[self.chosen]


class _Group:
    """Host-side view of one request: its rows and each particle's tokens and state."""

    def __init__(self, index: int, rows: list[int]) -> None:
        self.index = index  # the group's prompt within the wave
        self.rows = rows
        n = len(rows)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.reasons = ["length"] * n
        self.streamed = 0  # consensus tokens handed out so far
        self.resamplings = 0
        self.done = False

    def extend(self, i: int, new: list[int], max_new_tokens: int, stop: StopCriteria) -> int:
        """Append particle i's new tokens up to its end; returns how many of them were kept."""
        before = len(self.tokens[i])
        reason = stop.append(self.tokens[i], new, max_new_tokens)
        if reason is not None:
            self.finished[i], self.reasons[i] = True, reason
        return len(self.tokens[i]) - before

    def consensus(self) -> list[int]:
        """Tokens shared by every particle that were not handed out yet."""
        shared = common_prefix_length(self.tokens, self.streamed)
        new, self.streamed = self.tokens[0][self.streamed : shared], shared
        return new


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

    def _release(self, rows: list[int]) -> None:
        index = self._index(rows)
        self.state.release(index)
        self.proposal.release(index)

    def _index(self, values: list[int]) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=torch.int64), self.state.seq.device)

    def run(self, prompts: list[list[int]], max_new_tokens: int, stop: StopCriteria) -> Iterator[WaveEvent]:
        """Decode one wave (prompt g uses rows g*N .. g*N+N-1), yielding each group's consensus tokens as
        they settle and, when all its particles have finished, its result."""
        n = self.params.particles
        groups = [_Group(g, [g * n + i for i in range(n)]) for g in range(len(prompts))]
        try:
            logw, log_z = self._start(groups, prompts, max_new_tokens, stop)
            while True:
                yield from self._finish_groups(groups, logw, log_z)
                active = [(g, i) for g in groups for i in range(n) if not g.finished[i]]
                if not active:
                    return
                act = self._index([g.rows[i] for g, i in active])
                target, draft, logq, new_tokens = self._cycle(act, self.params.block_size)
                kept = [g.extend(i, new, max_new_tokens, stop) for (g, i), new in zip(active, new_tokens)]
                delta = weight_increments(
                    target, draft, logq, self._index(kept), self.params.alpha, self.params.temperature
                )
                logw.view(-1).index_add_(0, act, delta)  # row g*N+i is logw[g, i]
                live = list(dict.fromkeys(g for g, _ in active))
                self._release([g.rows[i] for g, i in active if g.finished[i]])
                self._maybe_resample(live, logw, log_z)
                for g in live:
                    if not all(g.finished) and (tokens := g.consensus()):
                        yield WaveEvent(g.index, tokens)
        finally:
            self._release([r for g in groups for r in g.rows])

    def _start(
        self, groups: list[_Group], prompts: list[list[int]], max_new_tokens: int, stop: StopCriteria
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the prompts, fan them out to N particles each, and draw every particle's own x0.
        Returns the log-weights [G, N] (the x0 term) and the log Ẑ accumulator [G]."""
        p = self.params
        n = p.particles
        first = self._index([g.rows[0] for g in groups])
        rows = self._index([r for g in groups for r in g.rows])
        self.state.load_prompts(first, prompts)
        self.proposal.load_prompts(first, prompts)
        self.set_len_bound(max(len(q) for q in prompts))
        prefill = self.state.forward(first, last_only=True)
        logits = prefill.logits[:, 0].float()  # the target at the last prompt token
        features = prefill if self.proposal.feature_layers else None  # for an EAGLE3 head drafting directly
        self.proposal.prefill(first, features)  # the proposal keeps the prompt's last token pending
        if n > 1:
            src = self._index([g.rows[0] for g in groups for _ in range(n - 1)])
            dst = self._index([r for g in groups for r in g.rows[1:]])
            self.state.fork(src, dst)
            self.proposal.fork(src, dst)
        x0, _ = sample(p.alpha * logits.repeat_interleave(n, 0), p.temperature, self.generator)
        prompt_len = self.state.seq_len[rows]
        self.state.append(rows, x0[:, None])
        group_of_row = torch.arange(len(groups), device=rows.device).repeat_interleave(n)
        self.proposal.accept(rows, prompt_len, x0, features and features.take(group_of_row))
        first_tokens = PendingRead(x0).result()
        for j, (g, i) in enumerate((g, i) for g in groups for i in range(n)):
            g.extend(i, [first_tokens[j]], max_new_tokens, stop)
        self._release([g.rows[i] for g in groups for i in range(n) if g.finished[i]])
        logw = log_normalizer(logits, p.alpha, p.temperature)[:, None].repeat(1, n)
        return logw, torch.zeros(len(groups), dtype=torch.float64, device=logw.device)

    def _cycle(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
        """One SMC cycle for active particle rows: the target logits [R, K+1, V], drafts and their log q,
        and the K+1 new tokens of each row (read to the host in one copy)."""
        p = self.params
        base = self.state.seq_len[rows]  # seq ends with the seed (last bonus / x0)
        if k:
            prop = self.proposal.propose(rows, k)
            draft, logq = prop.tokens, prop.logq
            self.state.append(rows, draft)
        else:
            draft = torch.zeros(len(rows), 0, dtype=torch.int64, device=rows.device)
            logq = torch.zeros(len(rows), 0, device=rows.device)
        step = self.state.forward(rows)
        target = step.last(k + 1).float()  # L_0..L_K
        bonus, _ = sample(p.alpha * target[:, k], p.temperature, self.generator)
        keep_len = base + k
        self.state.truncate(rows, keep_len, bonus, max_drop=k + 1)
        if k:
            self.proposal.accept(rows, keep_len, bonus, step if self.proposal.feature_layers else None)
        return target, draft, logq, PendingRead(torch.cat([draft, bonus[:, None]], 1)).result()

    def _maybe_resample(self, live: list[_Group], logw: torch.Tensor, log_z: torch.Tensor) -> None:
        """Resample the live groups whose ESS fell under τ·N (ESS and ancestors come to the host in one read);
        a resampled group's interval ends: log Ẑ gains logsumexp(logw) − log N and logw restarts at 0."""
        p = self.params
        n = p.particles
        index = self._index([g.index for g in live])
        ess = effective_sample_size(logw[index])
        self.cycles += len(live)
        self.ess_sum += (ess / n).sum()
        if n < 2 or p.ess_threshold <= 0:
            return
        if p.resampling == "systematic":
            u = torch.rand(len(live), generator=self.generator, device=logw.device, dtype=torch.float64)
            ancestors = systematic_ancestors(logw[index], u)
        else:
            u = torch.rand(len(live), n, generator=self.generator, device=logw.device, dtype=torch.float64)
            ancestors = multinomial_ancestors(logw[index], u)
        plan = PendingRead(torch.cat([ess[:, None], ancestors.double()], 1)).result()
        low = [(g, [int(a) for a in row[1:]]) for g, row in zip(live, plan) if row[0] < p.ess_threshold * n]
        if not low:
            return
        self.resamples += len(low)
        low_index = self._index([g.index for g, _ in low])
        log_z.index_add_(0, low_index, torch.logsumexp(logw[low_index], -1) - math.log(n))
        logw.index_fill_(0, low_index, 0.0)
        fork_src, fork_dst, dead = [], [], []
        for g, ancestors_of in low:
            g.resamplings += 1
            for i, a in enumerate(ancestors_of):
                if a == i:
                    continue
                if g.finished[a]:
                    if not g.finished[i]:
                        dead.append(g.rows[i])
                else:
                    fork_src.append(g.rows[a])
                    fork_dst.append(g.rows[i])
            g.tokens = [list(g.tokens[a]) for a in ancestors_of]
            g.finished = [g.finished[a] for a in ancestors_of]
            g.reasons = [g.reasons[a] for a in ancestors_of]
        if fork_src:
            src, dst = self._index(fork_src), self._index(fork_dst)
            self.state.fork(src, dst)
            self.proposal.fork(src, dst)
        if dead:
            self._release(dead)

    def _finish_groups(self, groups: list[_Group], logw: torch.Tensor, log_z: torch.Tensor) -> Iterator[WaveEvent]:
        """Select the returned particle of every group whose particles have all finished (one read for all)."""
        ready = [g for g in groups if not g.done and all(g.finished)]
        if not ready:
            return
        n = self.params.particles
        index = self._index([g.index for g in ready])
        w = logw[index]
        gumbel = gumbel_noise(w.shape, self.generator, w.device).double()
        chosen = select_particle(w, self.params.selection, gumbel)
        final_log_z = log_z[index] + torch.logsumexp(w, -1) - math.log(n)
        values = PendingRead(torch.cat([w, final_log_z[:, None], chosen[:, None].double()], 1)).result()
        for g, row in zip(ready, values):
            g.done = True
            result = GroupResult(g.tokens, g.reasons, row[:n], row[n], g.resamplings, int(row[n + 1]))
            yield WaveEvent(g.index, result.token_ids[g.streamed :], result.finish_reason, result)
