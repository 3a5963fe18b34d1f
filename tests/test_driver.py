"""The request driver: requests submitted and cancelled from other threads while others decode, failures that stay
with the requests they belong to, and a shutdown that ends what runs."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from conftest import make_tiny_model
from helpers import assert_pools_empty

from hsmc.decoder import HierarchicalDecoder
from hsmc.errors import RequestCancelled, RequestError
from hsmc.requests import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver")
    return str(make_tiny_model("llama", root / "a", seed=61)), str(make_tiny_model("llama", root / "b", seed=62))


STACKS = {
    "rejection": lambda a, b: [{"model": a, "temperature": 1.0}, {"kind": "rejection", "model": b, "temperature": 1.0}],
    "smc": lambda a, b: [{"model": a, "temperature": 1.0},
                         {"kind": "smc", "model": b, "temperature": 1.0, "particles": 3, "block_size": 2}],
}  # fmt: skip


class Collector:
    """A sink that keeps every request's increments (it runs on the driver's thread)."""

    def __init__(self) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.started = threading.Event()  # some request has output

    def __call__(self, increment) -> None:
        self.events.put(increment)
        self.started.set()

    def finals(self, count: int, timeout: float = 120) -> dict[int, object]:
        """The last increment of `count` requests, by index."""
        done: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(done) < count:
            inc = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if inc.result is not None or inc.error is not None:
                done[inc.index] = inc
        return done


@pytest.mark.parametrize("stack", list(STACKS))
def test_requests_join_and_cancel_from_another_thread_while_others_decode(models, stack):
    decoder = HierarchicalDecoder.from_config({"levels": STACKS[stack](*models)})
    driver, sink = decoder.driver, Collector()
    long = SamplingParams(max_tokens=1000, ignore_eos=True, seed=1)  # still running when it is cancelled
    first = driver.submit([[3, 4, 5]], [long], sink, indices=[0])
    started = threading.Event()

    def other_thread() -> None:  # joins the running batch, then cancels the first request
        sink.started.wait()
        driver.submit([[7, 8], [9]], [SamplingParams(max_tokens=6, seed=s) for s in (2, 3)], sink, indices=[1, 2])
        driver.cancel(first)
        started.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    finals = sink.finals(3)
    thread.join()
    assert started.is_set()
    assert isinstance(finals[0].error, RequestCancelled) and finals[0].result is None
    for i in (1, 2):  # the joiners finish with what they asked for, decoded as alone (their own seeds)
        alone = decoder.generate([[7, 8], [9]][i - 1 : i], params=SamplingParams(max_tokens=6, seed=i + 1))[0]
        assert finals[i].result.token_ids == alone.token_ids
    driver.quiesce()
    assert_pools_empty(decoder)


def test_a_request_whose_own_work_fails_fails_alone(models, monkeypatch):
    """A stop check that raises for one request (the one asking for 7 tokens) ends that request with the error;
    the others finish."""
    from hsmc.stopping import StopCriteria

    append = StopCriteria.append

    def failing(self, generated, new, max_new_tokens):
        if max_new_tokens == 7:
            raise ValueError("stop check failed")
        return append(self, generated, new, max_new_tokens)

    monkeypatch.setattr(StopCriteria, "append", failing)
    decoder = HierarchicalDecoder.from_config({"levels": STACKS["rejection"](*models)})
    sink = Collector()
    params = [SamplingParams(max_tokens=8, seed=1), SamplingParams(max_tokens=7), SamplingParams(max_tokens=8, seed=2)]
    decoder.driver.submit([[3], [4], [5]], params, sink)
    finals = sink.finals(3)
    errors = {i: inc.error for i, inc in finals.items()}
    assert isinstance(errors.pop(1), ValueError) and all(e is None for e in errors.values())
    decoder.driver.quiesce()
    assert_pools_empty(decoder)


def test_a_failed_launch_fails_its_requests_and_the_loop_serves_the_next(models):
    decoder = HierarchicalDecoder.from_config({"levels": STACKS["smc"](*models)})
    driver, sink = decoder.driver, Collector()
    launch = driver.top.launch
    calls = 0

    def once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("the device said no")
        return launch(*args, **kwargs)

    driver.top.launch = once
    driver.submit([[3, 4], [5]], [SamplingParams(max_tokens=30, ignore_eos=True)] * 2, sink, indices=[0, 1])
    finals = sink.finals(2)
    assert all(isinstance(f.error, RuntimeError) for f in finals.values())
    result = decoder.generate([[6, 7]], max_new_tokens=5, ignore_eos=True)[0]
    assert len(result.token_ids) == 5
    assert_pools_empty(decoder)


def test_shutdown_ends_running_requests_and_refuses_new_ones(models):
    decoder = HierarchicalDecoder.from_config({"levels": STACKS["rejection"](*models)})
    driver, sink = decoder.driver, Collector()
    driver.submit([[3, 4]], [SamplingParams(max_tokens=4000, ignore_eos=True)], sink, indices=[0])
    sink.started.wait()
    start = time.monotonic()
    driver.shutdown(timeout=0.2)
    assert time.monotonic() - start < 30
    assert isinstance(sink.finals(1)[0].error, RequestCancelled)
    with pytest.raises(RequestError, match="shutting down"):
        driver.submit([[3]], [SamplingParams()], sink)
    assert_pools_empty(decoder)


def test_an_admission_beside_running_rows_keeps_the_pending_bounds_of_a_fresh_batch(models):
    """Rows admitted while others decode leave every level's pending-token bound (a key of the captured cycles) as
    an admission into an idle stack does: the next cycle has the steady shape, not a wider one no warmup captured."""
    decoder = HierarchicalDecoder.from_config({"levels": STACKS["smc"](*models)})
    top = decoder.stack.top
    states = [f.owner for f in top.graph_parts().host if f.name == "pending_bound"]
    after_admissions, admit = [], top.admit

    def recording_admit(*args):
        launch = admit(*args)
        after_admissions.append([s.pending_bound for s in states])
        return launch

    top.admit = recording_admit
    driver, sink = decoder.driver, Collector()
    first = driver.submit([[3, 4, 5]], [SamplingParams(max_tokens=1000, ignore_eos=True, seed=1)], sink, indices=[0])
    sink.started.wait(timeout=120)
    driver.submit([[7, 8]], [SamplingParams(max_tokens=4, seed=2)], sink, indices=[1])
    assert sink.finals(1)[1].result is not None
    driver.cancel(first)
    driver.quiesce()
    assert len(after_admissions) == 2 and len(states) == 2
    assert after_admissions[1] == after_admissions[0]


def test_requests_arriving_together_at_an_idle_loop_are_admitted_in_one_wave(models, monkeypatch):
    """Concurrent clients reach a server over a few milliseconds: an idle loop gathers them, so they share one
    prefill and one cycle phase (each well within the gap after the last: all in one `admit`); a request after the
    quiet gap is admitted on its own. The gap is widened here so a loaded CI machine's scheduling cannot split it."""
    from hsmc.engine import driver as driver_module

    monkeypatch.setattr(driver_module, "BURST_GAP_SECONDS", 0.2)
    monkeypatch.setattr(driver_module, "BURST_WINDOW_SECONDS", 2.0)
    decoder = HierarchicalDecoder.from_config({"levels": STACKS["smc"](*models)})
    driver, sink = decoder.driver, Collector()
    waves: list[int] = []
    admit = driver.top.admit

    def counting_admit(groups, *args):
        waves.append(len(groups))
        return admit(groups, *args)

    driver.top.admit = counting_admit
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=5)
    for i in range(5):  # 15 of the 16 rows
        driver.submit([[3 + i, 4]], [params], sink, indices=[i])
        time.sleep(0.01)
    sink.finals(5)
    driver.submit([[9, 9]], [params], sink, indices=[5])
    sink.finals(1)
    driver.quiesce()
    assert waves == [5, 1], waves
    assert_pools_empty(decoder)
