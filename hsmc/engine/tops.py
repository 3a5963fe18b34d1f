"""What the request driver asks of a stack's top level, and the adapter that makes a model or rejection level one.

The driver (`hsmc.engine.driver`) owns the requests: admission, the overlap of launches and reads, ends, release
and streaming. A top level owns the device work and exposes only what a launch needs: `admit` new groups
(prefill; an smc top also fans out and draws each particle's first token), `launch` one step or cycle for the
running groups, `settle` a read (mirror what the device decided onto the groups' host views and hand back each
particle's new tokens), and for an smc top whose ends the host decides (stop strings), `weigh` them.

A `Group` is the host's view of one admitted request: its rows (one, or an smc request's N particles), each
particle's tokens and end, and how long its rows are as far as read (`length`) plus what launched steps not
read yet may add (`unread`): the driver tightens every level's length bound to the longest of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hsmc.engine.host_io import PendingRead, upload
from hsmc.streaming import common_prefix_length


class Group:
    """Host-side view of one request: its rows and each particle's tokens and state."""

    def __init__(self, request: Any, slot: int, particles: int, group_size: int, length: int) -> None:
        self.request = request  # the driver's request (its stop criteria and max_tokens)
        self.slot = slot  # its row group: rows slot*S .. slot*S+S-1 (S: the group size), particles first
        self.particles = particles
        self.rows = [slot * group_size + i for i in range(particles)]
        self.padding = [slot * group_size + i for i in range(particles, group_size)]
        self.tokens: list[list[int]] = [[] for _ in range(particles)]
        self.finished = [False] * particles
        self.reasons = ["length"] * particles
        self.length = length  # every particle's sequence length at the top, as far as read
        self.unread = 0  # tokens the launches not read yet may add to that length
        self.streamed = 0  # consensus tokens handed out so far
        self.live = True  # some particle unfinished, as far as read
        self.done = False  # finished, cancelled or failed: its rows are released
        self.cycles = 0  # smc: weighed cycles (the x0 step not counted)
        self.resamplings = 0
        self.deferred = 0  # smc cycles that waited for its block
        self.ess_sum = 0.0  # smc: Σ over weighed cycles of ESS / N
        self.counters: list[float] = []  # the rejection levels' (rounds, tokens) over its rows

    def extend(self, i: int, new: list[int]) -> int:
        """Append particle i's new tokens up to its end; returns how many of them were kept."""
        request = self.request
        before = len(self.tokens[i])
        reason = request.stop.append(self.tokens[i], new, request.max_tokens)
        if reason is not None:
            self.finished[i], self.reasons[i] = True, reason
        return len(self.tokens[i]) - before

    def resample(self, ancestors: list[int]) -> None:
        self.tokens = [list(self.tokens[a]) for a in ancestors]
        self.finished = [self.finished[a] for a in ancestors]
        self.reasons = [self.reasons[a] for a in ancestors]
        self.resamplings += 1

    def consensus(self) -> list[int]:
        """Tokens shared by every particle that were not handed out yet: no resampling can take them back (every
        particle at the end descends from a current one, and tokens are only ever appended)."""
        shared = common_prefix_length(self.tokens, self.streamed)
        new, self.streamed = self.tokens[0][self.streamed : shared], shared
        return new


@dataclass
class Launch:
    """A launched step (or an smc cycle, or the admission of new groups) and its one pending read."""

    groups: list[Group]
    read: PendingRead
    growth: int  # most tokens the step may add to each of its groups' rows
    weighed: bool = True  # False: an smc cycle whose ends the host decides; it is weighed before the next launch
    cycle: Any = None  # what the top keeps of it until it is settled


@dataclass
class Settled:
    tokens: list[list[list[int]] | None]  # per group of the launch: each particle's new tokens; None: deferred
    counters: list[list[float]]  # per row of the launch: every rejection level's (rounds, tokens) so far
    record: list[list[float]] | None = None  # smc: every slot's would-be result, taken after this launch
    ess: list[float] = field(default_factory=list)  # smc: each group's ESS / N before the cycle


class Top(Protocol):
    group_size: int  # rows per group: the largest N of the running smc requests, else 1

    def resize(self, group_size: int) -> None:
        """A new group size (only while no group runs)."""
        ...

    def admit(self, groups: list[Group], prompts: list[list[int]], bound: int, weigh: bool) -> Launch | None:
        """Prefill the new groups (`bound`: the longest row after loading them); a launch if it yields tokens
        (`weigh` as for `launch`)."""
        ...

    def launch(self, groups: list[Group], bound: int, weigh: bool) -> Launch:
        """One step (cycle) of the live groups; `weigh`: the device may decide the ends (no stop strings)."""
        ...

    def settle(self, launch: Launch, values: list) -> Settled: ...
    def weigh(self, launch: Launch, kept: list[int], ends: list[bool]) -> None: ...
    def outcome(self, group: Group, record: list[list[float]]) -> tuple[int, list[float], float]:
        """An smc group's chosen particle, log-weights and log Ẑ from a record taken after its last weighing."""
        ...

    def release(self, rows: list[int]) -> None: ...
    def set_len_bound(self, bound: int) -> None: ...


class StepTop:
    """A `model` or `rejection` level as the top: each launch is one `step` of every running row, handing over the
    1..γ+1 tokens each row committed. Ends are the host's: a finished row is released after the step the driver
    launched before reading it, whose tokens for it are dropped."""

    group_size = 1

    def __init__(self, level: Any) -> None:
        self.level = level
        self.device = level.state.seq.device

    def resize(self, group_size: int) -> None:
        if group_size != 1:
            raise ValueError(f"a {type(self.level).__name__} top decodes one row per request, not {group_size}")

    def admit(self, groups: list[Group], prompts: list[list[int]], bound: int, weigh: bool) -> None:
        rows = self._index([g.rows[0] for g in groups])
        self.level.load_prompts(rows, prompts)  # the bound covers them now
        self.level.prefill(rows)
        return None

    def launch(self, groups: list[Group], bound: int, weigh: bool) -> Launch:
        self.level.set_len_bound(bound)
        rows = self._index([g.rows[0] for g in groups])
        emission = self.level.step(rows)
        cycle = (emission.width, emission.choice)
        return Launch(groups, PendingRead(emission.record), self.level.step_growth, cycle=cycle)

    def settle(self, launch: Launch, values: list) -> Settled:
        width, choice = launch.cycle  # each row's record: its tokens (width), their count, its counters
        if choice is not None:  # a rejection step whose draft shape was chosen: what its rows kept
            self.level.observe(choice, [row[width] - 1 for row in values])
        return Settled([[row[: row[width]]] for row in values], [row[width + 1 :] for row in values])

    def weigh(self, launch: Launch, kept: list[int], ends: list[bool]) -> None:
        raise RuntimeError("a model or rejection top is never weighed")

    def outcome(self, group: Group, record: list[list[float]]) -> tuple[int, list[float], float]:
        raise RuntimeError("a model or rejection top has no particle system")

    def release(self, rows: list[int]) -> None:
        self.level.release(self._index(rows))

    def set_len_bound(self, bound: int) -> None:
        self.level.set_len_bound(bound)

    def _index(self, values: list[int]) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=torch.int64), self.device)
