"""WorkerLink.close() against the link's own refresh, which adds and drops per-worker probes (a
dns:/// target's addresses change): close never trips over a probe added meanwhile, and a refresh
after close opens no channel."""

from __future__ import annotations

import time

import pytest

from openjev.frontend import worker_link
from openjev.frontend.worker_link import WorkerLink

# gRPC's connectivity thread of a channel closed while it still connects raises "Channel closed!"
# in that (daemon) thread: grpc's own. Each test waits for it (settle) so that it is ignored here
# rather than reported under the next test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def settle() -> None:
    time.sleep(0.5)  # grpc's connectivity poll wakes every 0.2 s


def make_link() -> WorkerLink:
    # nothing listens there: nothing here dials the workers
    return WorkerLink("127.0.0.1:9,127.0.0.1:10", fingerprint="", max_length=16384)


def test_close_while_a_refresh_adds_a_probe():
    link = make_link()
    link._probes = {endpoint: worker_link._Probe(endpoint) for endpoint in ("127.0.0.1:9", "127.0.0.1:10")}
    first = next(iter(link._probes.values()))
    closed = []
    real_close = first.channel.close

    def close_then_refresh_adds() -> None:  # the fault: the link's thread adds a worker right now
        real_close()
        closed.append(first)
        link._probes["127.0.0.1:11"] = worker_link._Probe("127.0.0.1:11")

    first.channel.close = close_then_refresh_adds  # type: ignore[method-assign]
    link.close()  # before: RuntimeError, dictionary changed size during iteration
    assert closed == [first]
    settle()


def test_refresh_after_close_opens_no_probe():
    link = make_link()
    link.close()
    state = link.refresh()
    assert link._probes == {}
    assert state is link.state
    settle()
