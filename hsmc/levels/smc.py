"""`smc` level: SMC speculative decoding against a target model (DESIGN.md §3), top of a stack.

A request is a group of N particles (rows); requests of one batch may ask for different N. A group
occupies a slot of `group_size` consecutive rows (the largest N admitted together), its particles the first N
(the weight math runs on [groups, slot] tensors whose unused columns hold log-weight -inf; forwards take
the particles' rows only). The target prefills the prompt once and the prompt KV fans out to all
particles by refcount; each particle draws its own x0 from softmax(α·ℓ/T_t) (one
shared x0 would fix the first token's marginal at the local power, not the global p_T^α), with
the weight term log Σ p_T^α at that position. Each cycle the level below proposes K tokens per
particle, ONE target forward scores [seed, d_1..d_K], the bonus is drawn from softmax(α·L_K/T_t),
and log-weights (float64) grow by `weight_increments` over the tokens that belong to the output:
tokens after the one that ends a particle (stop token, stop string, max_tokens) never count.
When all particles of a group have finished, one is returned, drawn ∝ exp(logw) (Gumbel noise drawn
when the group starts) or the argmax, with all N particles, the estimate log Ẑ (Σ over resampling
intervals, the last included, of logsumexp(logw) − log N) and the number of resamplings.

The device decides the cycle. It starts with the resampling plan of every group (ESS test on the
weights so far; a live group with ESS < τ·N gets systematic ancestors, the others identity ancestors),
applied by one fork of every level (block tables and refcounts, no KV bytes). Then the proposal, the
verify, the bonus; without stop strings the ends of the particles (`output_ends`: stop token,
max_tokens) and the weights follow at once. A group whose proposal could not fill its block
(`Proposal.ready`, a rejection level below) is deferred: the target rolls back, nothing is weighed,
and the next cycle completes it. Finished particles ride along masked until their group is done.

The level is the `Top` the request driver (`hsmc.engine.driver`) launches: `admit` prefills new groups and draws
their x0, `launch` enqueues a cycle, `settle` mirrors a read on the groups' host views. The host reads once per
cycle: the ancestors, the resampled/live/stepped flags and ESS of each group, the K+1 new tokens of each
particle, the proposal's fill counters and every group's would-be result (weights, log Ẑ, chosen particle),
packed in one copy. Without stop strings the cycle is decided before the read, so the host reads cycle t while
cycle t+1 already runs (a finished group rides one extra cycle, masked). With stop strings the host must see the
text before the weights: the driver reads after the verify and `weigh`s each particle's kept count and end before
the next launch; a group finished by the host gets its result from the next read.

With `graph_cycles` (CUDA) a cycle whose ends the device decides — everything from the resampling plan to
the weights and the record — is a graphed unit (`Graphs`: one CUDA graph per shape — groups, rows, the planned
fill rounds — replayed), timed as a whole; the block fill's rounds inside it are plain code in its graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsmc.engine.graphs import GraphParts, Graphs, HostField
from hsmc.engine.host_io import PendingRead, read_counters, upload
from hsmc.engine.random_streams import DRAW, RESAMPLE, SELECT, RowStreams, purpose_of
from hsmc.engine.sampler import Law, RowLaws
from hsmc.engine.tops import Group, Launch, Settled
from hsmc.levels.base import Level, SequenceState
from hsmc.models.size import weight_bytes
from hsmc.ops.counter_hash import uniform
from hsmc.smc.ends import output_ends
from hsmc.smc.resampling import resampling_plan, select_particle
from hsmc.smc.weights import effective_sample_size, log_normalizer, weight_increments


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
class _Cycle:
    """One launched cycle (or the x0 step): its rows and the device values its weighing needs."""

    rows: torch.Tensor
    ancestors: torch.Tensor  # int64 [G, N], within each group
    flags: torch.Tensor  # bool [3, G]: resampled, live (before the cycle), stepped (not deferred)
    ess: torch.Tensor  # float64 [G]: ESS / N before the cycle
    go: torch.Tensor | None  # bool [R]: the row's group stepped (None once weighed)
    tokens: torch.Tensor  # int64 [R, W]: the new tokens (K drafts + bonus, or x0)
    scores: tuple[torch.Tensor, ...] | None = None  # target logits, drafts, log q, the law's scale and floors
    first: bool = False  # the x0 step of newly admitted groups


class SMCLevel:
    step_growth = 0  # not a `step`ping top: the driver launches its cycles

    def __init__(
        self,
        state: SequenceState,
        proposal: Level,
        params: SMCParams,
        laws: RowLaws,
        streams: RowStreams,
        salt: int,
        stop_ids: tuple[int, ...] = (),
        graph_cycles: bool = False,
    ) -> None:
        """`laws`: each row's target law p' (its request's temperature, top-k, top-p; the target is p'^alpha);
        `streams`, `salt`: its random streams and its depth under the top. `stop_ids`: the tokens that end a
        particle whose request does not ignore EOS. `graph_cycles`: capture each cycle as one CUDA graph (the
        runner must have CUDA graphs)."""
        self.state = state
        self.proposal = proposal
        self.params = params
        self.laws = laws
        self.streams = streams
        self.draw, self.select, self.resample = (purpose_of(salt, use) for use in (DRAW, SELECT, RESAMPLE))
        slots, device = state.seq.shape[0], state.seq.device
        self.logw = torch.zeros(slots, dtype=torch.float64, device=device)  # row g*N+i: particle i of group g
        self.log_z = torch.zeros(slots, dtype=torch.float64, device=device)  # per group: Σ over closed intervals
        self.noise = torch.zeros(slots, dtype=torch.float64, device=device)  # Gumbel noise of the final selection
        self.finished = torch.zeros(slots, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots, dtype=torch.int64, device=device)
        self.max_tokens = torch.ones(slots, dtype=torch.int64, device=device)  # per row: its request's
        self.eos = torch.ones(slots, dtype=torch.bool, device=device)  # per row: its request stops at stop_ids
        self.counts = torch.ones(slots, dtype=torch.int64, device=device)  # per group: its particles
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=device)
        self.group_size = params.particles  # rows per group slot: the largest N admitted together
        self.ess_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.cycles = self.group_cycles = self.resamples = self.deferred = 0
        if proposal.fill is not None:
            proposal.fill.block = params.block_size
            proposal.fill.rows = self.group_size
            proposal.fill.verify_rounds = weight_bytes(state.runner.module) / proposal.fill.round_bytes
        self.cycle_graphs = None
        self.replay_cycles = True  # off: launches run the captured cycle op by op (bench times its levels so)
        if graph_cycles:
            host = self.graph_parts().host
            self.cycle_graphs = Graphs(self._decided_cycle, state.runner.scope, host, state.timer.whole)

    def graph_parts(self) -> GraphParts:
        """What a cycle touches besides device tensors: every level's models and host ints."""
        own = [HostField(self, "group_size")]
        if (fill := self.proposal.fill) is not None:
            own += [HostField(fill, "planned")]
            own += [HostField(fill, "blocks", "count"), HostField(fill, "rounds_run", "count")]
        return self.state.graph_parts() + self.laws.graph_parts() + self.proposal.graph_parts() + GraphParts(host=own)

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
        if self.cycle_graphs is not None and self.replay_cycles:
            stats["graphed_cycles"] = self.cycle_graphs.replays
        return stats

    def row_counters(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return self.proposal.row_counters(rows)

    def set_len_bound(self, bound: int) -> None:
        self.state.bound_lengths(bound)
        self.proposal.set_len_bound(bound)

    # -- the driver's `Top` ------------------------------------------------------------------
    def resize(self, group_size: int) -> None:
        self.group_size = group_size
        if self.proposal.fill is not None:
            self.proposal.fill.rows = group_size

    def release(self, rows: list[int]) -> None:
        index = self._index(rows)
        self.state.release(index)
        self.proposal.release(index)

    def admit(self, groups: list[Group], prompts: list[list[int]], bound: int, weigh: bool) -> Launch:
        """Prefill the new groups' prompts, fan them out to N particles each, and draw every particle's own x0:
        a step of one token, launched like a cycle; the log-weights start at the x0 term. `bound`: the longest
        row of every group holding rows (these included) after loading them."""
        states = [f.owner for f in self.graph_parts().host if f.name == "pending_bound"]  # this level's and below
        with SequenceState.admitting(states):
            return self._admit(groups, prompts, bound, weigh)

    def _admit(self, groups: list[Group], prompts: list[list[int]], bound: int, weigh: bool) -> Launch:
        p = self.params
        first = self._index([g.rows[0] for g in groups])
        rows = self._index([r for g in groups for r in g.rows])
        group_of_row = self._index([j for j, g in enumerate(groups) for _ in g.rows])
        self.state.load_prompts(first, prompts)
        self.proposal.load_prompts(first, prompts)
        self.set_len_bound(bound)
        prefill = self.state.forward(first, last_only=True)
        logits = prefill.logits[:, 0].float()  # the target at the last prompt token
        features = prefill if self.proposal.feature_layers else None  # for an EAGLE3 head drafting directly
        self.proposal.prefill(first, features)  # the proposal keeps the prompt's last token pending
        if len(rows) > len(groups):
            src = self._index([g.rows[0] for g in groups for _ in g.rows[1:]])
            dst = self._index([r for g in groups for r in g.rows[1:]])
            self.state.fork(src, dst)
            self.proposal.fork(src, dst)
        law, per_row = self.laws.at(rows), logits[group_of_row]
        prompt_len = self.state.seq_len[rows]
        x0, _ = law.sample(per_row, self.streams.keys(rows, self.draw, prompt_len), p.alpha)  # p'^α normalized
        self.state.append(rows, x0[:, None])
        self.proposal.accept(rows, prompt_len, x0, features and features.take(group_of_row))
        self.logw[rows] = log_normalizer(per_row, p.alpha, _scale(law), law.floors(per_row), backend=law.backend)
        slots = self._index([g.slot for g in groups])
        self.log_z.index_fill_(0, slots, 0.0)
        self.counts[slots] = self._index([g.particles for g in groups])
        self.finished.index_fill_(0, rows, False)
        self.generated.index_fill_(0, rows, 0)
        per_row = [(g.request.max_tokens, not g.request.ignore_eos) for g in groups for _ in g.rows]
        self.max_tokens[rows] = self._index([m for m, _ in per_row])
        self.eos[rows] = upload(torch.tensor([e for _, e in per_row]), rows.device)
        if padding := [r for g in groups for r in g.padding]:  # columns of the slot no particle uses
            padding_rows = self._index(padding)
            self.logw.index_fill_(0, padding_rows, float("-inf"))
            self.finished.index_fill_(0, padding_rows, True)
        if len(rows) > len(groups) and p.selection == "sample":
            self.noise[rows] = -torch.log(-torch.log(uniform(self.streams.keys(rows, self.select, 0))))
        n = self.group_size
        identity = torch.arange(n, device=rows.device).expand(len(groups), n)
        flags = torch.ones(3, len(groups), dtype=torch.bool, device=rows.device)
        flags[0] = False  # no group resampled
        ess = torch.ones(len(groups), dtype=torch.float64, device=rows.device)
        go = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        step = _Cycle(rows, identity, flags, ess, go, x0[:, None], first=True)
        record = self._decide(step, self.stop_ids) if weigh else self._record()
        return self._launch_of(groups, step, record, growth=1, weighed=weigh)

    def launch(self, groups: list[Group], bound: int, weigh: bool) -> Launch:
        """Enqueue one cycle of the live `groups` and its read (none: only the read of the results, for groups the
        host has finished). `weigh`: the device decides the ends (no stop strings) and weighs at once."""
        self.set_len_bound(bound)
        if not groups:
            n, empty = self.group_size, torch.zeros(0, dtype=torch.int64, device=self.state.seq.device)
            flags = torch.zeros(3, 0, dtype=torch.bool, device=empty.device)
            step = _Cycle(empty, empty.view(0, n), flags, empty.double(), empty.bool(), empty.view(0, 1))
            return self._launch_of([], step, self._record(), growth=0, weighed=True)
        self.cycles += 1
        index = self._cycle_index(groups)
        growth = self.params.block_size + 1
        if not weigh:  # weighed once the host has read the text
            return self._launch_of(groups, self._cycle(*index), self._record(), growth, weighed=False)
        cycle = self.cycle_graphs if self.cycle_graphs is not None and self.replay_cycles else self._decided_cycle
        ancestors, flags, ess, tokens, record = cycle(*index, self.stop_ids)
        return self._launch_of(groups, _Cycle(index[0], ancestors, flags, ess, None, tokens), record, growth, True)

    def settle(self, launch: Launch, values: list) -> Settled:
        """Mirror a read on the host: the statistics, each live group's resampling of its particles' token lists,
        and every particle's new tokens (None for a group whose step was deferred)."""
        ancestors, (resampled, live, stepped), ess, tokens, *fill, counters, record = values
        if fill:
            self.proposal.fill.observe(fill)
        new: list[list[list[int]] | None] = []
        first = 0  # the group's first row in the launch's rows
        for j, g in enumerate(launch.groups):
            n = g.particles
            if resampled[j] and not g.done:
                g.resample([int(a) for a in ancestors[j][:n]])
            if live[j]:
                self.group_cycles += 1
                self.resamples += int(resampled[j])
                self.deferred += int(not stepped[j])
                if not launch.cycle.first:
                    g.cycles += 1
                    g.ess_sum += ess[j]
                    g.deferred += int(not stepped[j])
            new.append([[int(t) for t in tokens[first + i]] for i in range(n)] if stepped[j] else None)
            first += n
        return Settled(new, counters, record)

    def weigh(self, launch: Launch, kept: list[int], ends: list[bool]) -> None:
        """The ends the host found (stop strings): weights over each row's kept tokens, then its end."""
        device = launch.cycle.rows.device
        self._weigh(launch.cycle, self._index(kept), upload(torch.tensor(ends, dtype=torch.bool), device))

    def outcome(self, group: Group, record: list[list[float]]) -> tuple[int, list[float], float]:
        """(chosen particle, log-weights, log Ẑ) of a finished group, from a record taken after its last weighing."""
        row, n = record[group.slot], self.group_size
        return int(row[n + 1]), row[: group.particles], row[n]

    # -- internals ---------------------------------------------------------------------------
    def _index(self, values: list[int]) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=torch.int64), self.state.seq.device)

    def _launch_of(self, groups: list[Group], step: _Cycle, record: torch.Tensor, growth: int, weighed: bool) -> Launch:
        """The launch and its one packed read: ancestors, flags, ESS, tokens, the fill's counters, the rejection
        levels' per-row counters and the record."""
        fill = self.proposal.fill.counters() if self.proposal.fill is not None else []
        counters = torch.cat([*self.row_counters(step.rows), step.rows.new_zeros(len(step.rows), 0)], 1)
        read = PendingRead(step.ancestors, step.flags, step.ess, step.tokens, *fill, counters, record)
        return Launch(groups, read, growth, weighed, step)

    def _cycle_index(self, groups: list[Group]) -> tuple[torch.Tensor, ...]:
        """The cycle's rows, the groups' slots, each particle's place among the slots' rows (slot j's rows are
        j*N .. j*N+N-1) and each row's group, uploaded at once."""
        n = self.group_size
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
        return step.ancestors, step.flags, step.ess, step.tokens, record

    def _decide(self, step: _Cycle, stop_ids: torch.Tensor) -> torch.Tensor:
        """The ends and weights of a step the device decides (no stop strings); then every group's would-be result."""
        rows = step.rows
        kept, ends = output_ends(step.tokens, self.generated[rows], stop_ids, self.max_tokens[rows], self.eos[rows])
        self._weigh(step, kept, ends)
        return self._record()

    def _cycle(self, rows: torch.Tensor, slots: torch.Tensor, real: torch.Tensor, group_of_row: torch.Tensor) -> _Cycle:
        """Resampling plan and fork, K proposals, one target forward, the bonus (all on the device)."""
        p = self.params
        n, k, g = self.group_size, p.block_size, len(slots)
        grid = (slots[:, None] * n + torch.arange(n, device=rows.device)).reshape(-1)  # every row of the slots
        counts = self.counts[slots]
        logw = self.logw[grid].view(g, n)
        live = ~self.finished[grid].view(g, n).all(-1)
        resampled = torch.zeros(g, dtype=torch.bool, device=rows.device)
        ancestors = torch.arange(n, device=rows.device).expand(g, n)
        if n >= 2 and p.ess_threshold > 0:
            first = grid.view(g, n)[:, 0]  # each group's first particle: its key changes when the group resamples
            columns = 0 if p.resampling == "systematic" else torch.arange(n, device=rows.device).expand(g, n)
            uniforms = uniform(self.streams.keys(first, self.resample, columns))
            ancestors, resampled, ess = resampling_plan(logw, live, uniforms, p.ess_threshold, p.resampling, counts)
            closed = torch.logsumexp(logw, -1) - counts.double().log()
            self.log_z.index_add_(0, slots, torch.where(resampled, closed, 0.0))
            used = torch.arange(n, device=rows.device)[None, :] < counts[:, None]
            self.logw[grid] = torch.where(resampled[:, None] & used, 0.0, logw).reshape(-1)
            src = grid.view(g, n).gather(1, ancestors).reshape(-1)[real]  # identity rows copy onto themselves
            self.state.fork(src, rows)
            self.proposal.fork(src, rows)
            self.finished[rows], self.generated[rows] = self.finished[src], self.generated[src]
            self.streams.renew(rows, resampled[group_of_row])  # a copy must not redraw its ancestor's numbers
        else:
            ess = effective_sample_size(logw)
        ess = ess / counts
        self.ess_sum += (ess * live).sum()
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
        law = self.laws.at(rows)
        floors = law.floors(target)  # [R, K+1]: each position's support
        keys = self.streams.keys(rows, self.draw, base + k)
        bonus, _ = law.backend.gumbel_max(target[:, k], law.scale(p.alpha), floors[:, k], keys)
        # a deferred row drops its drafts and its seed's KV: the seed is processed again next cycle
        keep_len = torch.where(go, base + k, base - 1)
        self.state.truncate(rows, keep_len, torch.where(go, bonus, seed), max_drop=k + 1)
        if k:
            features = step if self.proposal.feature_layers else None
            mask = None if prop.ready is None else go
            self.proposal.accept(rows, base + k, bonus, features, mask=mask)
        flags = torch.stack([resampled, live, group_go])
        new_tokens = torch.cat([draft, bonus[:, None]], 1)
        return _Cycle(rows, ancestors, flags, ess, go, new_tokens, (target, draft, logq, _scale(law), floors))

    def _weigh(self, step: _Cycle, kept: torch.Tensor, ends: torch.Tensor) -> None:
        """Apply the ends (kept tokens [R], output ended [R]) of a step: weights over the kept tokens, the
        particles' lengths and finished flags. Rows already finished or deferred keep theirs."""
        rows = step.rows
        counted = step.go & ~self.finished[rows]
        kept = torch.where(counted, kept, 0)
        if step.scores is not None:
            target, draft, logq, scale, floors = step.scores
            delta = weight_increments(target, draft, logq, kept, self.params.alpha, scale, floors, self.laws.backend)
            self.logw.index_add_(0, rows, delta)
            step.scores = None  # the target logits [R, K+1, V] are not needed past here
        self.generated.index_add_(0, rows, kept)
        self.finished[rows] = self.finished[rows] | (ends & counted)

    def _record(self) -> torch.Tensor:
        """Every group's would-be result [G, N+2]: the log-weights, log Ẑ so far and the chosen particle."""
        n = self.group_size
        g = (self.logw.shape[0] - 1) // n  # every row group (row max_rows is the scratch row)
        w = self.logw[: g * n].view(g, n)
        chosen = select_particle(w, self.params.selection, self.noise[: g * n].view(g, n))
        log_z = self.log_z[:g] + torch.logsumexp(w, -1) - self.counts[:g].double().log()
        return torch.cat([w, log_z[:, None], chosen[:, None].double()], 1)


def _scale(law: Law) -> torch.Tensor:
    """1 / T per row in float64, the weights' precision."""
    return 1.0 / law.temperature.double()
