"""The worker's commit deadlines (openjev.worker.stream): one thread fires each deadline at its
time unless it was cancelled first, a later-scheduled earlier deadline included, and a cancelled
one releases its function at once (it holds the stream's context)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from openjev.worker.stream import CommitTimer, _Deadlines


def test_deadlines_fire_in_time_order_unless_cancelled():
    deadlines = _Deadlines()
    fired: list[str] = []
    done = threading.Event()

    def note(name: str):
        def fire() -> None:
            fired.append(name)
            if name == "last":
                done.set()

        return fire

    started = time.monotonic()  # before the first schedule: a loaded machine may pause between them
    deadlines.schedule(0.6, note("last"))
    cancelled = deadlines.schedule(0.2, note("cancelled"))
    # earlier than every pending deadline: the sleeping thread must be woken for it
    deadlines.schedule(0.1, note("early"))
    deadlines.schedule(0.3, note("middle"))
    deadlines.cancel(cancelled)
    deadlines.cancel(cancelled)  # twice, and after it would have fired: no effect
    assert done.wait(5)
    assert fired == ["early", "middle", "last"]
    assert time.monotonic() - started >= 0.55


def test_an_earlier_deadline_wakes_the_thread_sleeping_on_a_later_one():
    deadlines = _Deadlines()
    deadlines.schedule(30, lambda: None)
    time.sleep(0.05)  # the thread now sleeps until the 30 s deadline
    fired = threading.Event()
    started = time.monotonic()
    deadlines.schedule(0.05, fired.set)
    assert fired.wait(5)
    assert time.monotonic() - started < 2


def test_a_stopped_timer_fires_nothing_and_releases_its_callback():
    class Context:
        def cancel(self) -> None:
            raise AssertionError("a stopped timer must not cancel its stream")

    context = Context()
    alive = weakref.ref(context)
    timer = CommitTimer(0.1, context.cancel)
    timer.stop()
    del context
    gc.collect()
    assert alive() is None  # not held by the pending deadline for its whole timeout
    time.sleep(0.3)
    assert not timer.expired


def test_an_unstopped_timer_expires_and_cancels():
    cancelled = threading.Event()
    timer = CommitTimer(0.05, cancelled.set)
    assert cancelled.wait(5)
    assert timer.expired


def test_a_commit_while_the_deadline_fires_is_never_cancelled_late(monkeypatch):
    """The deadline thread takes the timer's function, then the stream commits and stops the
    timer before that function runs: the committed stream is not cancelled afterwards."""
    from openjev.worker import stream

    taken: list = []
    monkeypatch.setattr(stream._deadlines, "schedule", lambda seconds, fn: taken.append(fn) or 1)
    cancelled: list[bool] = []
    timer = CommitTimer(60.0, lambda: cancelled.append(True))
    timer.stop()  # the commit
    taken[0]()  # the deadline thread runs what it took before the stop
    assert not timer.expired and not cancelled


def test_a_deadline_past_the_longest_wait_and_a_failing_one_leave_the_thread_running():
    """A deadline beyond threading.TIMEOUT_MAX (a --commit-timeout-seconds of 1e10) made the
    thread's wait raise, and a function that raises ended it: later deadlines never fired. A
    cancelled far deadline no longer stays in the heap either."""
    deadlines = _Deadlines()
    far = [deadlines.schedule(1e10, lambda: None) for _ in range(3000)]
    fired = threading.Event()

    def broken() -> None:
        raise RuntimeError("a stream's cancel failed")

    deadlines.schedule(0.05, broken)
    deadlines.schedule(0.1, fired.set)
    assert fired.wait(5)
    for handle in far:
        deadlines.cancel(handle)
    assert len(deadlines._heap) <= 1024
