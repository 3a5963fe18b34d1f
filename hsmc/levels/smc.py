"""`smc` level: SMC speculative decoding against a target model (DESIGN.md §3), top of a stack.

A request is a group of N particles (rows); requests of one batch may ask for different N. A group
occupies a slot of as many consecutive rows as the largest N of the call, its particles the first N
(the weight math runs on [groups, slot] tensors whose unused columns hold log-weight -inf; forwards take
the particles' rows only). The target prefills the prompt once and the prompt KV fans out to all
particles by refcount; each particle draws its own x0 from softmax(α·ℓ/T_t) (one
shared x0 would fix the first token's marginal at the local power, not the global p_T^α), with
the weight term log Σ p_T^α at that position. Each cycle the level below proposes K tokens per
particle, ONE target forward scores [seed, d_1..d_K], the bonus is drawn from softmax(α·L_K/T_t),
and log-weights (float64) grow by `weight_increments` over the tokens that belong to the output:
tokens after the one that ends a particle (stop token, stop string, max_new_tokens) never count.
When all particles of a group have finished, one is returned, drawn ∝ exp(logw) (Gumbel noise drawn
when the group starts) or the argmax, with all N particles, the estimate log Ẑ (Σ over resampling
intervals, the last included, of logsumexp(logw) − log N) and the number of resamplings.

The device decides the cycle. It starts with the resampling plan of every group (ESS test on the
weights so far; a live group with ESS < τ·N gets systematic ancestors, the others identity ancestors),
applied by one fork of every level (block tables and refcounts, no KV bytes). Then the proposal, the
verify, the bonus; without stop strings the ends of the particles (`output_ends`: stop token,
max_new_tokens) and the weights follow at once. A group whose proposal could not fill its block
(`Proposal.ready`, a rejection level below) is deferred: the target rolls back, nothing is weighed,
and the next cycle completes it. Finished particles ride along masked until their group is done.

The host reads once per cycle: the ancestors and the resampled/live/deferred flag of each group, the
K+1 new tokens of each particle, the proposal's fill counters and every group's would-be result (weights,
log Ẑ, chosen particle), packed in one copy. Without stop strings the cycle is decided before the
read, so the host reads cycle t while cycle t+1 already runs (a finished group rides one extra cycle,
masked). With stop strings the host must see the text before the weights: it reads after the verify,
uploads each particle's kept count and end, and the weights follow; no overlap there, and a group
finished by the host gets its result from the next read (one more read after the last cycle).

With `graph_cycles` (CUDA) a cycle whose ends the device decides — everything from the resampling plan to
the weights and the record — is captured and replayed as one CUDA graph per shape (`RoundGraphs`: groups,
rows, the planned fill rounds), and timed as a whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from hsmc.engine.host_io import PendingRead, read_counters, upload
from hsmc.engine.round_graphs import GraphParts, HostField, RoundGraphs
from hsmc.engine.sampler import gumbel_noise, sample
from hsmc.engine.scheduler import Admission
from hsmc.levels.base import Level, SequenceState
from hsmc.models.shapes import weight_bytes
from hsmc.smc.resampling import resampling_plan, select_particle
from hsmc.smc.weights import effective_sample_size, log_normalizer, weight_increments
from hsmc.stopping import StopCriteria, output_ends
from hsmc.streaming import RequestEvent, common_prefix_length


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

    def __init__(self, index: int, slot: int, particles: int, slot_size: int, length: int) -> None:
        self.index = index  # the group's prompt
        self.slot = slot  # its row group: rows slot*S .. slot*S+S-1 (S: the call's largest N), particles first
        self.particles = particles
        self.rows = [slot * slot_size + i for i in range(particles)]
        self.padding = [slot * slot_size + i for i in range(particles, slot_size)]
        n = particles
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.reasons = ["length"] * n
        self.length = length  # every particle's sequence length at the target, as far as read
        self.unread = 0  # tokens the steps launched but not read yet may add to that length
        self.streamed = 0  # consensus tokens handed out so far
        self.resamplings = 0
        self.live = True  # some particle unfinished, as far as read
        self.done = False  # result handed out, rows released

    def extend(self, i: int, new: list[int], max_new_tokens: int, stop: StopCriteria) -> int:
        """Append particle i's new tokens up to its end; returns how many of them were kept."""
        before = len(self.tokens[i])
        reason = stop.append(self.tokens[i], new, max_new_tokens)
        if reason is not None:
            self.finished[i], self.reasons[i] = True, reason
        return len(self.tokens[i]) - before

    def resample(self, ancestors: list[int]) -> None:
        self.tokens = [list(self.tokens[a]) for a in ancestors]
        self.finished = [self.finished[a] for a in ancestors]
        self.reasons = [self.reasons[a] for a in ancestors]
        self.resamplings += 1

    def consensus(self) -> list[int]:
        """Tokens shared by every particle that were not handed out yet."""
        shared = common_prefix_length(self.tokens, self.streamed)
        new, self.streamed = self.tokens[0][self.streamed : shared], shared
        return new


@dataclass
class _Cycle:
    """One launched cycle (or the x0 step): its rows, the device values its weighing needs, its groups and
    its packed read."""

    rows: torch.Tensor
    ancestors: torch.Tensor  # int64 [G, N], within each group
    flags: torch.Tensor  # bool [3, G]: resampled, live (before the cycle), stepped (not deferred)
    go: torch.Tensor | None  # bool [R]: the row's group stepped (None once weighed)
    tokens: torch.Tensor  # int64 [R, W]: the new tokens (K drafts + bonus, or x0)
    scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # target logits, drafts, log q
    groups: list[_Group] = field(default_factory=list)
    read: PendingRead | None = None


class SMCLevel:
    step_growth = 0  # not a streaming top: `run` drives its own cycles

    def __init__(
        self,
        state: SequenceState,
        proposal: Level,
        params: SMCParams,
        generator: torch.Generator,
        graph_cycles: bool = False,
    ) -> None:
        """`graph_cycles`: capture each cycle as one CUDA graph (the runner must have CUDA graphs)."""
        self.state = state
        self.proposal = proposal
        self.params = params
        self.generator = generator
        slots, device = state.seq.shape[0], state.seq.device
        self.logw = torch.zeros(slots, dtype=torch.float64, device=device)  # row g*N+i: particle i of group g
        self.log_z = torch.zeros(slots, dtype=torch.float64, device=device)  # per group: Σ over closed intervals
        self.noise = torch.zeros(slots, dtype=torch.float64, device=device)  # Gumbel noise of the final selection
        self.finished = torch.zeros(slots, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots, dtype=torch.int64, device=device)
        self.counts = torch.ones(slots, dtype=torch.int64, device=device)  # per group: its particles
        self.slot_size = params.particles  # rows per group in the running `run`: its largest N
        self.stop_ids = torch.zeros(0, dtype=torch.int64, device=device)  # of the running `run`:
        self.max_new_tokens = 0
        self.device_ends = True  # no stop strings: the device finds the ends, the read overlaps the next cycle
        self.awaiting: list[_Group] = []  # finished by the host (stop strings): results come with the next read
        self.ess_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.cycles = self.group_cycles = self.resamples = self.deferred = 0
        if proposal.fill is not None:
            proposal.fill.block = params.block_size
            proposal.fill.verify_rounds = weight_bytes(state.runner.module) / proposal.fill.round_bytes
        self.cycle_graphs = None
        if graph_cycles:
            buckets = state.runner.graphs.context_buckets
            self.cycle_graphs = RoundGraphs(self._decided_cycle, self.graph_parts(), buckets, generator)

    def graph_parts(self) -> GraphParts:
        """What a cycle touches besides device tensors: every level's runners, timers and host ints."""
        own = [HostField(self, "slot_size"), HostField(self, "max_new_tokens")]
        if (fill := self.proposal.fill) is not None:
            own += [HostField(fill, "planned")]
            own += [HostField(fill, "blocks", "count"), HostField(fill, "rounds_run", "count")]
        return self.state.graph_parts() + self.proposal.graph_parts() + GraphParts(host=own)

    def reset_stats(self) -> None:
        self.state.timer.reset()
        self.cycles = self.group_cycles = self.resamples = self.deferred = 0
        self.ess_sum.zero_()
        if self.cycle_graphs is not None:
            self.cycle_graphs.replays = 0

    def stats(self) -> dict[str, float]:
        """With graphed cycles `forward_seconds` / `forwards` time whole cycles (the proposal's included), and
        `graphed_cycles` counts the replays."""
        group_cycles = max(self.group_cycles, 1)
        stats = {
            "cycles": self.cycles,
            "mean_ess_fraction": read_counters(self.ess_sum)[0] / group_cycles,
            "resample_rate": self.resamples / group_cycles,
            "deferred_step_rate": self.deferred / group_cycles,
            "forward_seconds": self.state.timer.seconds(),
            "forwards": self.state.timer.count,
        }
        if self.cycle_graphs is not None:
            stats["graphed_cycles"] = self.cycle_graphs.replays
        return stats

    def set_len_bound(self, bound: int) -> None:
        self.state.bound_lengths(bound)
        self.proposal.set_len_bound(bound)

    def _release(self, rows: list[int]) -> None:
        index = self._index(rows)
        self.state.release(index)
        self.proposal.release(index)

    def _index(self, values: list[int]) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=torch.int64), self.state.seq.device)

    def run(
        self,
        prompts: list[list[int]],
        admission: Admission,
        max_new_tokens: int,
        stop: StopCriteria,
        particles: list[int] | None = None,
    ) -> Iterator[RequestEvent]:
        """Decode the prompts: each is admitted into a free row group (its N particles: `particles[i]`, by
        default the level's N) between cycles and decoded with the groups already running (continuous
        batching). Yields each group's consensus tokens as they settle and, when all its particles have
        finished, its result.

        Without stop strings the device decides each cycle's ends, so the next cycle is launched before the
        host reads this one (overlap). With stop strings every read is weighed before the next launch."""
        particles = particles or [self.params.particles] * len(prompts)
        self.slot_size = max(particles)
        if self.proposal.fill is not None:
            self.proposal.fill.rows = self.slot_size
        self.stop_ids = self._index(sorted(stop.token_ids))
        self.max_new_tokens, self.device_ends, self.awaiting = max_new_tokens, not stop.strings, []
        groups: list[_Group] = []  # admitted, result not handed out yet
        reads: deque[_Cycle] = deque()  # launched, not read yet, oldest first
        try:
            while True:
                if admitted := admission.admit():
                    if not groups:  # no row holds anything: bounds left by earlier rows must not widen forwards
                        self.set_len_bound(0)
                    new = [_Group(i, slot, particles[i], self.slot_size, len(prompts[i])) for i, slot in admitted]
                    groups += new
                    reads.append(self._start(new, [prompts[i] for i, _ in admitted], groups))
                launched = False
                if not self.device_ends:  # the host decides the ends: each step is read and weighed first
                    while reads:
                        yield from self._take(reads.popleft(), stop, admission)
                if self.awaiting or any(g.live for g in groups):
                    reads.append(self._launch(groups))
                    launched = self.device_ends  # runs on while the host reads the steps before it
                if not reads:
                    return
                while len(reads) > launched:
                    yield from self._take(reads.popleft(), stop, admission)
                groups = [g for g in groups if not g.done]
        finally:
            self._release([r for g in groups if not g.done for r in g.rows])

    def _take(self, step: _Cycle, stop: StopCriteria, admission: Admission) -> Iterator[RequestEvent]:
        """Read a launched step: hand out the groups the host finished at the previous read (this record was
        taken after their weighing), mirror the step on the host, and with stop strings weigh it."""
        *values, record = step.read.result()
        yield from self._results(self.awaiting, record, admission)
        events, self.awaiting, kept, ends = self._settle(step, values, stop)
        yield from events
        if self.device_ends:
            yield from self._results(self.awaiting, record, admission)  # that record was taken after these ends
            self.awaiting = []
        else:
            device = step.rows.device
            self._weigh(step, self._index(kept), upload(torch.tensor(ends, dtype=torch.bool), device))

    def _bound_lengths(self, groups: list[_Group]) -> None:
        """Tighten the length bound to what the groups holding rows may have reached (read + launched)."""
        self.set_len_bound(max(g.length + g.unread for g in groups if not g.done))

    def _start(self, groups: list[_Group], prompts: list[list[int]], running: list[_Group]) -> _Cycle:
        """Prefill the new groups' prompts, fan them out to N particles each, and draw every particle's own x0:
        a step of one token, launched like a cycle; the log-weights start at the x0 term. `running`: every
        group holding rows, these included."""
        p = self.params
        first = self._index([g.rows[0] for g in groups])
        rows = self._index([r for g in groups for r in g.rows])
        group_of_row = self._index([j for j, g in enumerate(groups) for _ in g.rows])
        self.state.load_prompts(first, prompts)
        self.proposal.load_prompts(first, prompts)
        self._bound_lengths(running)
        prefill = self.state.forward(first, last_only=True)
        logits = prefill.logits[:, 0].float()  # the target at the last prompt token
        features = prefill if self.proposal.feature_layers else None  # for an EAGLE3 head drafting directly
        self.proposal.prefill(first, features)  # the proposal keeps the prompt's last token pending
        if len(rows) > len(groups):
            src = self._index([g.rows[0] for g in groups for _ in g.rows[1:]])
            dst = self._index([r for g in groups for r in g.rows[1:]])
            self.state.fork(src, dst)
            self.proposal.fork(src, dst)
        x0, _ = sample(logits[group_of_row], p.temperature / p.alpha, self.generator)  # softmax(α·ℓ/T)
        prompt_len = self.state.seq_len[rows]
        self.state.append(rows, x0[:, None])
        self.proposal.accept(rows, prompt_len, x0, features and features.take(group_of_row))
        self.logw[rows] = log_normalizer(logits, p.alpha, p.temperature)[group_of_row]
        slots = self._index([g.slot for g in groups])
        self.log_z.index_fill_(0, slots, 0.0)
        self.counts[slots] = self._index([g.particles for g in groups])
        self.finished.index_fill_(0, rows, False)
        self.generated.index_fill_(0, rows, 0)
        if padding := [r for g in groups for r in g.padding]:  # columns of the slot no particle uses
            padding_rows = self._index(padding)
            self.logw.index_fill_(0, padding_rows, float("-inf"))
            self.finished.index_fill_(0, padding_rows, True)
        if len(rows) > len(groups) and p.selection == "sample":
            self.noise[rows] = gumbel_noise((len(rows),), self.generator, rows.device).double()
        n = self.slot_size
        identity = torch.arange(n, device=rows.device).expand(len(groups), n)
        flags = torch.ones(3, len(groups), dtype=torch.bool, device=rows.device)
        flags[0] = False  # no group resampled
        go = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        for g in groups:
            g.unread += 1
        step = _Cycle(rows, identity, flags, go, x0[:, None], groups=groups)
        return self._read(step, self._decide(step, self.stop_ids))

    def _launch(self, groups: list[_Group]) -> _Cycle:
        """Enqueue one cycle of the live groups and its read (no live group: only the read of the results,
        for groups the host has finished)."""
        live = [g for g in groups if g.live]
        self._bound_lengths(groups)
        for g in live:
            g.unread += self.params.block_size + 1
        if not live:
            n, empty = self.slot_size, torch.zeros(0, dtype=torch.int64, device=self.state.seq.device)
            flags = torch.zeros(3, 0, dtype=torch.bool, device=empty.device)
            step = _Cycle(empty, empty.view(0, n), flags, empty.bool(), empty.view(0, 1))
            return self._read(step, self._decide(step, self.stop_ids))
        self.cycles += 1
        index = self._cycle_index(live)
        if not self.device_ends:  # weighed once the host has read the text
            step = self._cycle(*index)
            step.groups = live
            return self._read(step, self._record())
        with self.state.timer() if self.cycle_graphs is not None else nullcontext():
            ancestors, flags, tokens, record = (self.cycle_graphs or self._decided_cycle)(*index, self.stop_ids)
        return self._read(_Cycle(index[0], ancestors, flags, None, tokens, groups=live), record)

    def _cycle_index(self, groups: list[_Group]) -> tuple[torch.Tensor, ...]:
        """The cycle's rows, the groups' slots, each particle's place among the slots' rows (slot j's rows are
        j*N .. j*N+N-1) and each row's group, uploaded at once."""
        n = self.slot_size
        rows = [r for g in groups for r in g.rows]
        slots = [g.slot for g in groups]
        real = [j * n + i for j, g in enumerate(groups) for i in range(g.particles)]
        group_of_row = [j for j, g in enumerate(groups) for _ in g.rows]
        index = self._index(rows + slots + real + group_of_row)
        return index.split([len(rows), len(slots), len(real), len(group_of_row)])

    def _decided_cycle(self, *index_and_stop_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A cycle whose ends the device decides, weighed: what its read takes (the unit `cycle_graphs` captures).
        Takes `_cycle_index`'s tensors and the stop ids."""
        *index, stop_ids = index_and_stop_ids
        step = self._cycle(*index)
        record = self._decide(step, stop_ids)
        return step.ancestors, step.flags, step.tokens, record

    def _decide(self, step: _Cycle, stop_ids: torch.Tensor) -> torch.Tensor:
        """The ends and weights of a step the device decides (no stop strings); then every group's would-be result."""
        if self.device_ends:
            kept, ends = output_ends(step.tokens, self.generated[step.rows], stop_ids, self.max_new_tokens)
            self._weigh(step, kept, ends)
        return self._record()

    def _read(self, step: _Cycle, record: torch.Tensor) -> _Cycle:
        """Pack the step's one read: ancestors, flags, tokens, the fill's counters and the record."""
        fill = self.proposal.fill.counters() if self.proposal.fill is not None else []
        step.read = PendingRead(step.ancestors, step.flags, step.tokens, *fill, record)
        return step

    def _cycle(self, rows: torch.Tensor, slots: torch.Tensor, real: torch.Tensor, group_of_row: torch.Tensor) -> _Cycle:
        """Resampling plan and fork, K proposals, one target forward, the bonus (all on the device)."""
        p = self.params
        n, k, g = self.slot_size, p.block_size, len(slots)
        grid = (slots[:, None] * n + torch.arange(n, device=rows.device)).reshape(-1)  # every row of the slots
        counts = self.counts[slots]
        logw = self.logw[grid].view(g, n)
        live = ~self.finished[grid].view(g, n).all(-1)
        resampled = torch.zeros(g, dtype=torch.bool, device=rows.device)
        ancestors = torch.arange(n, device=rows.device).expand(g, n)
        if n >= 2 and p.ess_threshold > 0:
            shape = (g,) if p.resampling == "systematic" else (g, n)
            uniforms = torch.rand(shape, generator=self.generator, device=rows.device, dtype=torch.float64)
            ancestors, resampled, ess = resampling_plan(logw, live, uniforms, p.ess_threshold, p.resampling, counts)
            closed = torch.logsumexp(logw, -1) - counts.double().log()
            self.log_z.index_add_(0, slots, torch.where(resampled, closed, 0.0))
            used = torch.arange(n, device=rows.device)[None, :] < counts[:, None]
            self.logw[grid] = torch.where(resampled[:, None] & used, 0.0, logw).reshape(-1)
            src = grid.view(g, n).gather(1, ancestors).reshape(-1)[real]  # identity rows copy onto themselves
            self.state.fork(src, rows)
            self.proposal.fork(src, rows)
            self.finished[rows], self.generated[rows] = self.finished[src], self.generated[src]
        else:
            ess = effective_sample_size(logw)
        self.ess_sum += (ess / counts * live).sum()
        base = self.state.seq_len[rows]  # seq ends with the seed (last bonus / x0)
        seed = self.state.seq[rows, base - 1]
        group_go = torch.ones(g, dtype=torch.bool, device=rows.device)
        if k:
            prop = self.proposal.propose(rows, k)
            draft, logq = prop.tokens, prop.logq
            if prop.ready is not None:  # a group steps when all its particles have their block
                ready = torch.ones(g * n, dtype=torch.bool, device=rows.device)
                ready[real] = prop.ready
                group_go = ready.view(g, n).all(-1)
            self.state.append(rows, draft)
        else:
            draft = torch.zeros(len(rows), 0, dtype=torch.int64, device=rows.device)
            logq = torch.zeros(len(rows), 0, device=rows.device)
        go = group_go[group_of_row]
        step = self.state.forward(rows)
        target = step.last(k + 1)  # L_0..L_K, in the model's dtype (weighed without a float64 copy)
        bonus, _ = sample(target[:, k], p.temperature / p.alpha, self.generator)  # softmax(α·ℓ/T)
        # a deferred row drops its drafts and its seed's KV: the seed is processed again next cycle
        keep_len = torch.where(go, base + k, base - 1)
        self.state.truncate(rows, keep_len, torch.where(go, bonus, seed), max_drop=k + 1)
        if k:
            features = step if self.proposal.feature_layers else None
            mask = None if prop.ready is None else go
            self.proposal.accept(rows, base + k, bonus, features, mask=mask)
        flags = torch.stack([resampled, live, group_go])
        new_tokens = torch.cat([draft, bonus[:, None]], 1)
        return _Cycle(rows, ancestors, flags, go, new_tokens, (target, draft, logq))

    def _weigh(self, step: _Cycle, kept: torch.Tensor, ends: torch.Tensor) -> None:
        """Apply the ends (kept tokens [R], output ended [R]) of a step: weights over the kept tokens, the
        particles' lengths and finished flags. Rows already finished or deferred keep theirs."""
        rows = step.rows
        counted = step.go & ~self.finished[rows]
        kept = torch.where(counted, kept, 0)
        if step.scores is not None:
            target, draft, logq = step.scores
            delta = weight_increments(target, draft, logq, kept, self.params.alpha, self.params.temperature)
            self.logw.index_add_(0, rows, delta)
            step.scores = None  # the target logits [R, K+1, V] are not needed past here
        self.generated.index_add_(0, rows, kept)
        self.finished[rows] = self.finished[rows] | (ends & counted)

    def _record(self) -> torch.Tensor:
        """Every group's would-be result [G, N+2]: the log-weights, log Ẑ so far and the chosen particle."""
        n = self.slot_size
        g = (self.logw.shape[0] - 1) // n  # every row group (row max_rows is the scratch row)
        w = self.logw[: g * n].view(g, n)
        chosen = select_particle(w, self.params.selection, self.noise[: g * n].view(g, n))
        log_z = self.log_z[:g] + torch.logsumexp(w, -1) - self.counts[:g].double().log()
        return torch.cat([w, log_z[:, None], chosen[:, None].double()], 1)

    def _settle(
        self, step: _Cycle, values: list, stop: StopCriteria
    ) -> tuple[list[RequestEvent], list[_Group], list[int], list[bool]]:
        """Mirror a read step on the host: resample the groups' token lists, append the new tokens up to each
        particle's end. Returns the consensus events, the groups now finished, and each row's kept count and
        end (what the device is told with stop strings)."""
        ancestors, (resampled, live, stepped), tokens, *fill = values
        if fill:
            self.proposal.fill.observe(fill)
        kept: list[int] = []
        ends: list[bool] = []
        first = 0  # the group's first row in the step's rows
        for j, g in enumerate(step.groups):
            if resampled[j]:
                g.resample([int(a) for a in ancestors[j][: g.particles]])
            if live[j]:
                self.group_cycles += 1
                self.resamples += int(resampled[j])
                self.deferred += int(not stepped[j])
            g.unread -= len(tokens[first])
            if stepped[j]:
                g.length += len(tokens[first])
            for i in range(g.particles):
                was = g.finished[i]
                new = [int(t) for t in tokens[first + i]]
                kept.append(g.extend(i, new, self.max_new_tokens, stop) if stepped[j] and not was else 0)
                ends.append(g.finished[i])
            first += g.particles
        events, finished = [], []
        for g in step.groups:
            if g.live and all(g.finished):
                g.live = False
                finished.append(g)
            elif g.live and (new_tokens := g.consensus()):
                events.append(RequestEvent(g.index, new_tokens))
        return events, finished, kept, ends

    def _results(self, groups: list[_Group], record: list[list[float]], admission: Admission) -> Iterator[RequestEvent]:
        """Hand out the results of finished groups from a record taken after their last weighing; their rows
        go back to the admission."""
        n = self.slot_size
        if groups:
            self._release([r for g in groups for r in g.rows])
        for g in groups:
            row = record[g.slot]
            g.done = True
            admission.finish(g.index)
            result = GroupResult(g.tokens, g.reasons, row[: g.particles], row[n], g.resamplings, int(row[n + 1]))
            yield RequestEvent(g.index, result.token_ids[g.streamed :], result.finish_reason, result)
