"""The one request loop every stack runs under, on its own thread.

Requests are submitted and cancelled from any thread while others decode. The loop thread owns the stack: it
admits waiting requests into free row groups between launches (`Admission`: rows and KV slots), launches one step
or cycle of every running group through the top level (`hsmc.engine.tops.Top`), and reads each launch once while
the next one already runs (overlap), except after a launch whose ends the host must weigh first (an smc top with
stop strings). It applies every request's ends (stop tokens, stop strings, max_tokens), releases finished,
cancelled and failed requests' rows, and hands each request's settled output to its `sink` as `Increment`s, on the
loop thread: text that can no longer change (for an smc top the consensus prefix of its particles), then the
`Result`. A request that fails in its own host-side work fails alone; an error in a launch fails the requests it
carried and the loop goes on with the rest.

Under tensor parallelism (`hsmc.engine.ranks`) every rank runs this loop: rank 0's opens each turn by broadcasting
what it took from other threads (new requests with their resolved parameters, cancellations, the stack's mode) as a
`Turn`, and the other ranks' `follow` runs the same turn from it. Everything else a turn decides (admission,
launches, ends, releases) follows from those inputs and from device results that are identical on every rank.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch

from hsmc.engine.ranks import Ranks
from hsmc.engine.scheduler import Admission
from hsmc.engine.tops import Group, Launch, Top
from hsmc.errors import RequestCancelled, RequestError
from hsmc.requests import Increment, Particle, Result, SamplingParams, SMCOutcome, fresh_seed
from hsmc.stopping import StopCriteria
from hsmc.streaming import TextStream

Sink = Callable[[Increment], None]
IDLE_CHECK_SECONDS = 1.0  # how often an idle loop looks whether its decoder is gone
# An idle loop's first request waits while others keep arriving (each within BURST_GAP_SECONDS of the last, at most
# BURST_WINDOW_SECONDS in all), so concurrent clients whose requests reach the server over a few milliseconds are
# admitted in one wave: a request that misses a wave waits for the next launch, a whole SMC cycle (0.4-0.5 s for the
# hierarchical stack on an H100), and then runs out of phase with the others to the end.
BURST_GAP_SECONDS = 0.003
BURST_WINDOW_SECONDS = 0.03


@dataclass
class _Request:
    id: int
    index: int  # what its increments call it
    prompt: list[int]
    params: SamplingParams  # resolved: no None left
    stop: StopCriteria
    text: TextStream
    sink: Sink
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    group: Group | None = None

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens  # type: ignore[return-value]

    @property
    def ignore_eos(self) -> bool:
        return self.params.ignore_eos


@dataclass(frozen=True)
class Turn:
    """The inputs of one turn that rank 0 took from other threads, as the following ranks receive them."""

    requests: list[tuple[int, int, list[int], SamplingParams]]  # id, index, prompt, resolved parameters
    cancels: list[int]
    mode: Any  # the stack's mode (`Stack.mode`): what the host sets besides requests that changes device work


def _discard(increment: Increment) -> None:
    """A following rank's sink: rank 0 hands out the outputs."""


@dataclass(frozen=True)
class Defaults:
    """What a request's unset parameters become, and what the stack offers."""

    max_tokens: int
    temperature: float  # the top level's
    particles: int  # N of an smc top (1 otherwise)
    ignore_eos: bool
    stop: tuple[str, ...]  # for a request that names none
    smc: bool
    vocab_size: int


class RequestDriver:
    """Continuous batching for one stack, driven by a thread of its own (started by the first submission). The
    thread stays for the driver's life — a new thread would set up its CUDA library handles again, a stall of
    about a second on an H100 — but holds the driver only weakly while idle, so a decoder nobody uses is freed
    and its thread ends."""

    def __init__(
        self,
        top: Top,
        admission: Admission,
        defaults: Defaults,
        eos_token_ids: frozenset[int],
        tokenizer: Any | None,
        level_kinds: Sequence[str],
        prepare: Callable[[list[Group]], None] | None = None,
        forget: Callable[[list[int]], None] | None = None,
        ranks: Ranks | None = None,
        mode: Callable[[], Any] | None = None,
    ) -> None:
        """`level_kinds`: the stack's level kinds, bottom to top (for each request's level statistics); `prepare`:
        called with newly admitted groups before their prefill (their rows' random streams and sampling law),
        `forget` with the rows of every released one. `ranks`: the tensor-parallel group this rank decodes in
        (rank 0 broadcasts every turn's inputs, `mode()` among them; other ranks `follow`)."""
        self.top = top
        self.admission = admission
        self.defaults = defaults
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.level_kinds = list(level_kinds)
        self.prepare = prepare
        self.forget = forget
        self.ranks, self.mode = ranks, mode
        self._taken: list[_Request] = []  # taken from the inbox since the last turn (for the following ranks)
        self._ids = count()
        self._wake = threading.Condition()
        self._inbox: list[_Request] = []
        self._cancels: dict[int, BaseException] = {}
        self._closing = False
        self._idle = True  # no loop thread runs: nothing in flight
        self._thread: threading.Thread | None = None
        # owned by the loop thread
        self._requests: dict[int, _Request] = {}  # submitted, not ended
        self._groups: list[Group] = []  # admitted, not done
        self._reads: deque[Launch] = deque()  # launched, not read yet, oldest first
        self._awaiting: list[Group] = []  # ended by the host; their results come with the next read

    # -- any thread ---------------------------------------------------------------------------
    def resolve(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """`params` with every unset field filled in, or a RequestError naming the field that cannot be served."""
        d = self.defaults
        max_tokens = params.max_tokens if params.max_tokens is not None else d.max_tokens
        temperature = params.temperature if params.temperature is not None else d.temperature
        if params.particles is not None and not d.smc:
            raise RequestError(f"particles={params.particles}: only an smc top level has particles", "particles")
        if d.smc and temperature == 0:
            raise RequestError(
                "temperature=0 under an smc top: its importance weights need the target at a temperature > 0",
                "temperature",
            )
        stop = params.stop if params.stop is not None else d.stop
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model folder ships none", "stop")
        particles = params.particles or d.particles
        problem = self.admission.problem(prompt_tokens, max_tokens, particles)
        if problem is not None:
            if particles > self.admission.max_rows:
                field = "particles"
            elif self.admission.problem(prompt_tokens, 1, particles) is None:  # it fits with one new token
                field = "max_tokens" if params.max_tokens is not None else "prompt"
            else:
                field = "prompt"
            raise RequestError(f"the prompt has {prompt_tokens} tokens; {problem}", field)
        seed = params.seed if params.seed is not None else fresh_seed()
        return SamplingParams(
            max_tokens=max_tokens,
            stop=stop,
            seed=seed,
            temperature=temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            particles=particles,
            ignore_eos=params.ignore_eos or d.ignore_eos,
        )

    def submit(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        sink: Sink,
        indices: Sequence[int] | None = None,
    ) -> list[int]:
        """Queue requests (in order, atomically: requests submitted together may be admitted together); returns
        their ids. Every request is checked first, so a RequestError leaves nothing queued. `indices`: what their
        increments call them (default: their ids)."""
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if not prompt:
                raise RequestError("the prompt has no tokens", "prompt")
            vocab = self.defaults.vocab_size
            if bad := [t for t in prompt if not 0 <= t < vocab]:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
            rid = next(self._ids)
            index = rid if indices is None else indices[i]
            requests.append(self._request(rid, index, list(prompt), self.resolve(p, len(prompt)), sink))
        with self._wake:
            if self._closing:
                raise RequestError("the decoder is shutting down: no new requests")
            self._inbox += requests
            self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_run, args=(weakref.ref(self), self._wake), name="hsmc-driver", daemon=True
                )
                self._thread.start()
                atexit.register(_stop_at_exit, weakref.ref(self))  # no device work may run on into exit
        return [r.id for r in requests]

    def _request(self, rid: int, index: int, prompt: list[int], resolved: SamplingParams, sink: Sink) -> _Request:
        eos = frozenset() if resolved.ignore_eos else self.eos_token_ids
        stop = StopCriteria(eos, resolved.stop, self.tokenizer)
        return _Request(rid, index, prompt, resolved, stop, TextStream(self.tokenizer, stop), sink)

    def cancel(self, request_ids: Sequence[int], reason: BaseException | None = None) -> None:
        """End these requests (waiting or running) with `reason` (default RequestCancelled); ended ones are left."""
        with self._wake:
            for rid in request_ids:
                self._cancels[rid] = reason or RequestCancelled(f"request {rid} was cancelled")
            self._wake.notify()

    def shutdown(self, timeout: float = 0.0) -> None:
        """Refuse new requests, give the queued and running ones `timeout` seconds to finish, cancel the rest and
        stop the loop thread."""
        deadline = time.monotonic() + timeout
        with self._wake:
            self._closing = True
            self._wake.notify_all()
            while not self._idle and time.monotonic() < deadline:
                self._wake.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
            self._cancels.update({rid: RequestCancelled("shut down") for rid in self._open_ids()})
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def quiesce(self) -> bool:
        """True once the loop has stopped with nothing in flight (it waits for the reads of requests that just
        ended), False at once if requests are queued or running."""
        with self._wake:
            while not self._pending() and not self._idle:
                self._wake.wait()
            return not self._pending()

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not admitted yet."""
        with self._wake:
            return len(self._inbox) + len(self.admission.waiting)

    @property
    def running_rows(self) -> int:
        return sum(len(g.rows) for g in list(self._groups))

    def _work(self) -> bool:
        return bool(self._inbox or self._cancels or self._requests)

    def _pending(self) -> bool:
        return bool(self._inbox or self._requests)

    def _open_ids(self) -> list[int]:
        return [r.id for r in self._inbox] + list(self._requests)

    # -- the loop thread ----------------------------------------------------------------------
    def _next(self) -> bool:
        """Under the lock: take the new requests and cancellations, or mark the loop idle. False: nothing to do."""
        if not self._work():
            self._idle = True
            self._wake.notify_all()
            return False
        if self._idle and not self._requests:
            self._gather_burst()
        self._idle = False
        for r in self._inbox:  # under the lock: `queue_depth` counts them in one place or the other
            self._accept(r)
        if self.ranks is not None:
            self._taken += self._inbox
        self._inbox = []
        return True

    def _gather_burst(self) -> None:
        """Under the lock: wait while requests keep arriving after the first (see BURST_GAP_SECONDS)."""
        deadline = time.monotonic() + BURST_WINDOW_SECONDS
        seen = 0
        while len(self._inbox) > seen and not self._closing and (left := deadline - time.monotonic()) > 0:
            seen = len(self._inbox)
            self._wake.wait(min(BURST_GAP_SECONDS, left))

    def _accept(self, r: _Request) -> None:
        self._requests[r.id] = r
        self.admission.add(r.id, len(r.prompt), r.max_tokens, r.params.particles)  # type: ignore[arg-type]

    def _turn(self) -> None:
        """One turn of the loop: end what was cancelled, then admit, launch and read (after telling the following
        ranks what this turn took)."""
        with self._wake:
            cancels, self._cancels = self._cancels, {}
        if self.ranks is not None:
            taken, self._taken = self._taken, []
            mode = self.mode() if self.mode is not None else None
            try:
                self.ranks.broadcast(Turn([(r.id, r.index, r.prompt, r.params) for r in taken], list(cancels), mode))
            except Exception as e:  # a rank is gone: no request can run any more
                self._fail_running(e)
                for r in list(self._requests.values()):
                    self._end(r, e)
                return
        self._run_turn(cancels)

    def follow(self, set_mode: Callable[[Any], None]) -> None:
        """A following rank's loop: run the turns rank 0 broadcasts, in its mode (`set_mode`), until it stops."""
        with torch.inference_mode():
            while (turn := self.ranks.broadcast()) is not None:  # type: ignore[union-attr]
                for rid, index, prompt, params in turn.requests:
                    self._accept(self._request(rid, index, prompt, params, _discard))
                set_mode(turn.mode)
                self._run_turn({rid: RequestCancelled(f"request {rid} was cancelled") for rid in turn.cancels})

    def _run_turn(self, cancels: dict[int, BaseException]) -> None:
        for rid, reason in cancels.items():
            if rid in self._requests:
                self._end(self._requests[rid], reason)
        try:
            self._iterate()
        except Exception as e:  # a launch failed: the requests it carried fail, the loop goes on
            self._fail_running(e)

    def _iterate(self) -> None:
        """Admit what fits, launch one step of the live groups, read every launch but the newest."""
        admitted = self.admission.admit()
        if admitted:
            if self.top.group_size != self.admission.group_size:
                self.top.resize(self.admission.group_size)
            if not self._groups:  # no row holds anything: bounds left by earlier rows must not widen forwards
                self.top.set_len_bound(0)
            new = []
            for rid, slot in admitted:
                r = self._requests[rid]
                r.group = Group(r, slot, r.params.particles, self.admission.group_size, len(r.prompt))  # type: ignore[arg-type]
                new.append(r.group)
            self._groups += new
            if self.prepare is not None:
                self.prepare(new)
            weigh = not any(g.request.stop.strings for g in new)
            self._launched(self.top.admit(new, [g.request.prompt for g in new], self._bound(), weigh))
        if any(not launch.weighed for launch in self._reads):  # the host weighs it before the next launch
            while self._reads:
                self._take(self._reads.popleft())
        live = [g for g in self._groups if g.live and not g.done]
        keep = 0
        if live or self._awaiting:
            launch = self.top.launch(live, self._bound(), not any(g.request.stop.strings for g in live))
            self._launched(launch)
            keep = int(launch.weighed)  # runs on while the host reads the launches before it
        while len(self._reads) > keep:
            self._take(self._reads.popleft())
        self._groups = [g for g in self._groups if not g.done]
        if not self._groups:  # the launch run past the last request's end: read it, so nothing stays in flight
            while self._reads:
                self._take(self._reads.popleft())

    def _launched(self, launch: Launch | None) -> None:
        if launch is not None:
            for g in launch.groups:
                g.unread += launch.growth
            self._reads.append(launch)

    def _bound(self) -> int:
        """The longest any row holding something may be once every launch so far has run."""
        return max((g.length + g.unread for g in self._groups if not g.done), default=0)

    def _take(self, launch: Launch) -> None:
        """Read a launch: hand out the results of groups the host ended at the previous read (this record was taken
        after their weighing), apply each particle's new tokens up to its end, stream what settled, and either
        hand out the groups that ended (the device weighed them) or weigh the ends the host found."""
        settled = self.top.settle(launch, launch.read.result())
        awaiting, self._awaiting = self._awaiting, []
        self._finish(awaiting, settled.record)
        kept: list[int] = []
        ends: list[bool] = []
        ended = []
        first = 0  # the group's first row among the launch's
        for g, new in zip(launch.groups, settled.tokens):
            g.unread -= launch.growth
            counters = settled.counters[first : first + g.particles]
            first += g.particles
            row_kept, row_ends = [0] * g.particles, [False] * g.particles  # what weighs nothing
            if not g.done:
                try:
                    row_ends = list(g.finished)
                    if new is not None:
                        row_kept, row_ends = self._extend(g, new, counters)
                    if all(g.finished) and g.live:
                        g.live = False
                        ended.append(g)
                    else:
                        self._stream(g)
                except Exception as e:  # this request's own host-side work failed: it fails alone
                    self._end(g.request, e)
                    row_kept, row_ends = [0] * g.particles, [False] * g.particles
            kept += row_kept
            ends += row_ends
        if launch.weighed:
            self._finish(ended, settled.record)
        else:
            self.top.weigh(launch, kept, ends)
            self._awaiting = [g for g in ended if not g.done]

    def _extend(self, g: Group, new: list[list[int]], counters: list[list[float]]) -> tuple[list[int], list[bool]]:
        """Append every particle's new tokens up to its end: (kept per particle, ended per particle)."""
        g.length += len(new[0])
        kept = [0 if g.finished[i] else g.extend(i, tokens) for i, tokens in enumerate(new)]
        g.counters = [sum(column) for column in zip(*counters)]
        if g.request.first_token is None and any(g.tokens):
            g.request.first_token = time.perf_counter()
        return kept, list(g.finished)

    def _stream(self, g: Group) -> None:
        r = g.request
        new = g.consensus()
        text = r.text.update(g.tokens[0][: g.streamed]) if new else ""
        self._send(r, Increment(r.index, new, text, None, max(map(len, g.tokens)), self._levels(g)))

    def _finish(self, groups: list[Group], record: list[list[float]] | None) -> None:
        """Hand out the results of ended groups (`record`: an smc top's, taken after their last weighing)."""
        for g in groups:
            if g.done:
                continue
            r = g.request
            try:
                result = self._result(g, record)
            except Exception as e:
                self._end(r, e)
                continue
            self._release(r)
            increment = Increment(
                r.index, result.token_ids[g.streamed :], r.text.finish(result.token_ids), result,
                len(result.token_ids), result.levels,
            )  # fmt: skip
            self._send(r, increment)

    def _result(self, g: Group, record: list[list[float]] | None) -> Result:
        r = g.request
        smc, chosen, log_z = None, 0, None
        if record is not None:
            chosen, log_weights, log_z = self.top.outcome(g, record)
            particles = [
                Particle(tokens, r.text.final_text(tokens), weight, reason)
                for tokens, weight, reason in zip(g.tokens, log_weights, g.reasons)
            ]
            smc = SMCOutcome(particles, chosen, log_z, g.resamplings)
        tokens = g.tokens[chosen]
        seconds = time.perf_counter() - r.submitted
        stats = {
            "new_tokens": len(tokens),
            "seconds": seconds,
            "tokens_per_s": len(tokens) / seconds,
            "first_token_seconds": (r.first_token or time.perf_counter()) - r.submitted,
        }
        levels = self._levels(g, log_z)
        return Result(r.text.final_text(tokens), tokens, g.reasons[chosen], stats, smc, levels)

    def _levels(self, g: Group, log_z: float | None = None) -> list[dict[str, Any]]:
        """The request's own statistics per level, bottom to top."""
        counters = iter(zip(g.counters[0::2], g.counters[1::2]))  # rejection levels, top first
        rejection = {}
        for i in reversed(range(len(self.level_kinds))):
            if self.level_kinds[i] == "rejection":
                rounds, tokens = next(counters, (0, 0))
                rejection[i] = {"mean_accepted_length": tokens / rounds if rounds else 0.0, "rounds": int(rounds)}
        levels = []
        for i, kind in enumerate(self.level_kinds):
            stats: dict[str, Any] = {"kind": kind, **rejection.get(i, {})}
            if kind == "smc":
                cycles = max(g.cycles, 1)
                stats.update(
                    cycles=g.cycles,
                    mean_ess_fraction=g.ess_sum / cycles if g.cycles else 1.0,
                    resample_rate=g.resamplings / cycles,
                    deferred_step_rate=g.deferred / cycles,
                    resamplings=g.resamplings,
                )
                if log_z is not None:
                    stats["log_z"] = log_z
            levels.append(stats)
        return levels

    def _release(self, r: _Request) -> None:
        """Give a request's rows and slots back; it leaves the loop."""
        self._requests.pop(r.id, None)
        g = r.group
        if g is None:
            self.admission.finish(r.id)
            return
        if not g.done:
            g.done = True
            try:
                self.top.release(g.rows)
            finally:  # the host's accounting is freed even if the device's release fails
                if self.forget is not None:
                    self.forget(g.rows)
                self.admission.finish(r.id)

    def _end(self, r: _Request, error: BaseException) -> None:
        """End a request early (cancelled, or failed): its rows are freed and its sink told why."""
        if r.id not in self._requests:
            return
        try:
            self._release(r)
        finally:  # a release that fails (a broken device) still ends the request
            self._requests.pop(r.id, None)
            self._send(r, Increment(r.index, [], "", None, 0, [], error))

    def _send(self, r: _Request, increment: Increment) -> None:
        """Hand an increment to the request's sink; a sink that raises (its consumer is gone) ends the request."""
        try:
            r.sink(increment)
        except Exception:
            if r.id in self._requests and increment.error is None:
                if self.ranks is not None:  # released at the next turn, on every rank
                    self.cancel([r.id])
                else:
                    self._release(r)

    def _fail_running(self, error: Exception) -> None:
        """A launch failed: fail every admitted request (their state on the device is unknown) and drop the reads.
        If even that fails, every request fails: the loop must end with nothing left waiting."""
        self._reads.clear()
        self._awaiting = []
        groups, self._groups = self._groups, []
        try:
            for g in groups:
                self._end(g.request, error)
        except Exception:
            for r in list(self._requests.values()):
                self._requests.pop(r.id, None)
                self._send(r, Increment(r.index, [], "", None, 0, [], error))


def _run(ref: weakref.ref[RequestDriver], wake: threading.Condition) -> None:
    """The loop thread: turns while there is work; idle, it waits holding only `ref`, and ends when the driver is
    gone or shut down."""
    with torch.inference_mode():
        while True:
            with wake:
                driver = ref()
                if driver is None:
                    return
                if not driver._next():
                    if driver._closing:
                        driver._thread = None
                        return
                    del driver  # wait without keeping the driver alive
                    wake.wait(IDLE_CHECK_SECONDS)
                    continue
            driver._turn()
            del driver


def _stop_at_exit(driver: weakref.ref[RequestDriver]) -> None:
    if (alive := driver()) is not None:
        alive.shutdown()
