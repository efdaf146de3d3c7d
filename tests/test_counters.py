"""What communication costs a rank, as the communicators count it (unit tier, no MPI):
counters that add into their parents, busy time counted once where collectives overlap,
a blocked second counted once by the outermost call and never on a communication thread,
requests that count their wait and their span, the traffic of the steps, the trace."""

import threading
import time

import pytest

from mpitrain.comm import CommStats, CommThread, Request, SingleComm, trace_operations
from mpitrain.comm.requests import blocking
from mpitrain.observe.timing import Traffic


def test_a_communicators_counter_adds_into_the_one_it_was_made_from():
    world = SingleComm()
    dp = world.dup()
    bucket, node = dp.dup(), dp.split(0, 0)
    bucket.stats.add(sent=5, received=2)
    node.stats.add(sent=3, seconds=0.5)
    assert (bucket.stats.bytes_sent, node.stats.bytes_sent, dp.stats.bytes_sent, world.stats.bytes_sent) == \
        (5, 3, 8, 8)
    assert dp.stats.bytes_received == 2 and dp.stats.seconds == world.stats.seconds == 0.5


def test_busy_time_counts_overlapping_collectives_once():
    stats = CommStats()
    for span in [(0.0, 2.0), (1.0, 3.0), (1.5, 2.5), (5.0, 6.0)]:  # the first three overlap
        stats.add(span=span)
    assert stats.busy == 4.0


def test_a_blocked_second_is_counted_once_by_the_outermost_call_and_traced_if_a_collective():
    outer, inner, seen = CommStats(), CommStats(), []
    with trace_operations(lambda *event: seen.append(event)):
        with blocking(outer, "allreduce", 64):
            with blocking(inner):  # a ring's messages, waited for inside its wait
                time.sleep(0.01)
    assert outer.seconds >= 0.01 and inner.seconds == 0.0
    assert outer.busy == pytest.approx(outer.seconds)  # a blocking collective is busy while it blocks
    assert [(name, nbytes) for name, _, _, nbytes in seen] == [("allreduce", 64)]


class Slow(Request):
    """A request done after ``seconds`` of waiting."""

    def __init__(self, stats, seconds, name=""):
        super().__init__(stats, name, 8)
        self.seconds = seconds

    def _progress(self):
        return False

    def _block(self):
        time.sleep(self.seconds)


def test_a_request_counts_its_wait_as_blocked_and_a_collectives_life_as_busy():
    stats = CommStats()
    started = Slow(stats, 0.0, "allreduce")
    time.sleep(0.02)  # computing while it is in flight
    started.wait()
    assert stats.seconds < 0.01 <= stats.busy  # hidden: busy, not blocked
    p2p = Slow(stats, 0.01)  # a message: its wait is blocked time, its life not busy time
    busy = stats.busy
    p2p.wait()
    assert stats.seconds >= 0.01 and stats.busy == busy
    assert p2p.done and p2p.test()


def test_the_communication_threads_calls_are_busy_and_its_errors_reach_the_waiting_thread():
    stats = CommStats()
    thread = CommThread(stats, "test-comm")

    def collective():
        with blocking(stats, "allreduce", 8):
            time.sleep(0.02)

    request = thread.submit(collective)
    request.wait()
    assert stats.busy >= 0.02  # the thread's blocking call: busy on its counter
    assert stats.seconds < stats.busy + 0.01  # blocked: only the training thread's wait

    def fails():
        raise RuntimeError("the allreduce failed")

    with pytest.raises(RuntimeError, match="the allreduce failed"):
        thread.submit(fails).wait()
    tested = thread.submit(fails)  # tested once it has run, then waited: the error is not lost
    tested.event.wait()
    with pytest.raises(RuntimeError, match="the allreduce failed"):
        tested.test()
    with pytest.raises(RuntimeError, match="the allreduce failed"):
        tested.wait()
    thread.close()


def test_counters_lose_nothing_when_two_threads_add():
    stats = CommStats(parent=CommStats())
    add = lambda: [stats.add(sent=1, seconds=1e-6) for _ in range(20_000)]  # noqa: E731
    threads = [threading.Thread(target=add) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.bytes_sent == stats.parent.bytes_sent == 40_000


def test_the_traffic_of_the_steps_by_axis():
    """Only what grows between a step's begin and end counts; exposed is the data- and
    tensor-parallel axes' blocked time, total the larger of it and their busy time, the
    bubble the pipeline's blocked time."""
    dp, pp, tp = CommStats(), CommStats(), CommStats()
    traffic = Traffic({"dp": dp, "pp": pp, "tp": tp})
    dp.add(sent=100, seconds=9.0)  # before the step (the first broadcast): not counted
    traffic.begin()
    dp.add(sent=10, seconds=1.0, span=(0.0, 3.0))
    tp.add(sent=4, seconds=0.5, span=(10.0, 10.5))
    pp.add(sent=2, seconds=2.0)
    traffic.end()
    traffic.end()  # an end without a begin adds nothing
    assert traffic.seconds() == (1.5, 3.5, 2.0)
    assert traffic.by_axis() == {"dp": (10, 1.0), "pp": (2, 2.0), "tp": (4, 0.5)}
