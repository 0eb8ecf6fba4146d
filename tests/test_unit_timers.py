"""Unit tests of supervisor/timers.py driven by an explicit fake clock (``now`` is passed in)."""

from __future__ import annotations

from modelwarden.supervisor.timers import Timers


class Log:
    """Collects what fired, in order."""

    def __init__(self) -> None:
        self.fired: list = []

    def __call__(self, *args) -> None:
        self.fired.append(args if len(args) != 1 else args[0])


def test_empty_timers():
    timers = Timers()
    assert len(timers) == 0
    assert timers.next_due() is None
    assert timers.run_due(1e12) == 0


def test_fires_in_deadline_order_with_args():
    timers, log = Timers(), Log()
    timers.call_at(30.0, log, "c")
    timers.call_at(10.0, log, "a")
    timers.call_at(20.0, log, "b", 2)
    assert len(timers) == 3
    assert timers.next_due() == 10.0
    assert timers.run_due(25.0) == 2
    assert log.fired == ["a", ("b", 2)]
    assert len(timers) == 1
    assert timers.next_due() == 30.0
    assert timers.run_due(30.0) == 1  # due exactly at now fires
    assert log.fired == ["a", ("b", 2), "c"]
    assert len(timers) == 0 and timers.next_due() is None


def test_nothing_fires_before_its_time():
    timers, log = Timers(), Log()
    timers.call_at(100.0, log, "x")
    assert timers.run_due(99.999) == 0
    assert log.fired == [] and len(timers) == 1


def test_equal_deadlines_fire_in_scheduling_order():
    timers, log = Timers(), Log()
    for index in range(50):
        timers.call_at(5.0, log, index)
    assert timers.run_due(5.0) == 50
    assert log.fired == list(range(50))


def test_cancel_prevents_firing_and_updates_len():
    timers, log = Timers(), Log()
    a = timers.call_at(1.0, log, "a")
    timers.call_at(2.0, log, "b")
    timers.cancel(a)
    assert len(timers) == 1
    timers.cancel(a)  # twice: counted once
    timers.cancel(None)  # nothing: a no-op
    assert len(timers) == 1
    assert timers.run_due(10.0) == 1
    assert log.fired == ["b"]
    assert len(timers) == 0


def test_cancel_after_firing_is_a_no_op_and_keeps_len_right():
    timers, log = Timers(), Log()
    a = timers.call_at(1.0, log, "a")
    b = timers.call_at(2.0, log, "b")
    assert timers.run_due(1.5) == 1
    timers.cancel(a)  # already fired
    timers.cancel(a)
    assert len(timers) == 1
    assert timers.next_due() == 2.0
    assert timers.run_due(5.0) == 1
    assert log.fired == ["a", "b"]
    assert len(timers) == 0
    timers.cancel(b)
    assert len(timers) == 0
    c = timers.call_at(6.0, log, "c")
    assert len(timers) == 1
    timers.cancel(c)
    assert len(timers) == 0
    assert timers.next_due() is None


def test_next_due_skips_cancelled_timers():
    timers, log = Timers(), Log()
    first = timers.call_at(1.0, log, "first")
    second = timers.call_at(2.0, log, "second")
    timers.call_at(3.0, log, "third")
    timers.cancel(first)
    timers.cancel(second)
    assert timers.next_due() == 3.0
    assert len(timers) == 1
    assert timers.next_due() == 3.0  # asking again changes nothing
    assert len(timers) == 1
    assert timers.run_due(3.0) == 1
    assert log.fired == ["third"]


def test_run_due_returns_only_timers_that_fired():
    timers, log = Timers(), Log()
    handles = [timers.call_at(float(i), log, i) for i in range(10)]
    for handle in handles[::2]:
        timers.cancel(handle)
    assert timers.run_due(100.0) == 5
    assert log.fired == [1, 3, 5, 7, 9]
    assert len(timers) == 0


def test_many_cancellations_compact_the_heap():
    timers, log = Timers(), Log()
    handles = [timers.call_at(1000.0 + i, log, i) for i in range(3000)]
    for handle in handles[:2500]:  # requests that finished long before their deadline
        timers.cancel(handle)
    assert len(timers) == 500
    # the heap was rebuilt: it holds far fewer than the 3000 entries ever scheduled
    assert len(timers._heap) < 1500
    assert timers.next_due() == 3500.0
    timers.cancel(handles[0])  # cancelling a compacted-away timer again changes nothing
    assert len(timers) == 500
    assert timers.run_due(1e9) == 500
    assert log.fired == list(range(2500, 3000))
    assert len(timers) == 0 and timers.next_due() is None


def test_few_cancellations_do_not_compact():
    timers, log = Timers(), Log()
    handles = [timers.call_at(float(i), log, i) for i in range(100)]
    for handle in handles[:90]:
        timers.cancel(handle)
    assert len(timers) == 10
    assert len(timers._heap) == 100  # below the 1024 threshold: left for run_due/next_due to pop
    assert timers.run_due(1e9) == 10
    assert log.fired == list(range(90, 100))
    assert len(timers._heap) == 0 and len(timers) == 0


def test_compaction_interleaved_with_firing_keeps_count_exact():
    timers, log = Timers(), Log()
    handles = [timers.call_at(float(i), log, i) for i in range(5000)]
    assert timers.run_due(999.0) == 1000  # 0..999 fired
    for handle in handles[:3000]:  # 1000 of these already fired: no-ops
        timers.cancel(handle)
    assert len(timers) == 2000
    for handle in handles[3000:4500]:
        timers.cancel(handle)
    assert len(timers) == 500
    assert timers.run_due(1e9) == 500
    assert log.fired == list(range(1000)) + list(range(4500, 5000))
    assert len(timers) == 0


def test_callbacks_may_schedule_timers_while_run_due_runs():
    timers, log = Timers(), Log()

    def chain(step: int) -> None:
        log(("chain", step))
        if step < 3:
            timers.call_at(10.0 + step, chain, step + 1)  # due within this run_due
        timers.call_at(100.0 + step, log, ("later", step))  # not due yet

    timers.call_at(10.0, chain, 0)
    assert timers.run_due(20.0) == 4
    assert log.fired == [("chain", 0), ("chain", 1), ("chain", 2), ("chain", 3)]
    assert len(timers) == 4
    assert timers.next_due() == 100.0
    assert timers.run_due(200.0) == 4
    assert log.fired[4:] == [("later", 0), ("later", 1), ("later", 2), ("later", 3)]
    assert len(timers) == 0


def test_callback_scheduling_in_the_past_fires_in_the_same_run():
    timers, log = Timers(), Log()
    timers.call_at(5.0, lambda: timers.call_at(1.0, log, "past"))
    timers.call_at(6.0, log, "six")
    assert timers.run_due(6.0) == 3
    assert log.fired == ["past", "six"]  # the new timer's deadline (1.0) sorts before 6.0


def test_callbacks_may_cancel_pending_timers():
    timers, log = Timers(), Log()
    victim = timers.call_at(2.0, log, "victim")
    timers.call_at(1.0, timers.cancel, victim)
    timers.call_at(3.0, log, "survivor")
    assert len(timers) == 3
    assert timers.run_due(10.0) == 2  # the canceller and the survivor
    assert log.fired == ["survivor"]
    assert len(timers) == 0


def test_a_callback_cancelling_itself_changes_nothing():
    timers, log = Timers(), Log()
    holder = {}

    def self_cancel() -> None:
        timers.cancel(holder["me"])
        log("ran")

    holder["me"] = timers.call_at(1.0, self_cancel)
    timers.call_at(2.0, log, "next")
    assert timers.run_due(1.0) == 1
    assert len(timers) == 1
    assert timers.run_due(2.0) == 1
    assert log.fired == ["ran", "next"]
    assert len(timers) == 0
