"""WorkerLink.close() against the link's own refresh, which adds and drops per-worker probes (a
dns:/// target's addresses change) and calls them: close never trips over a refresh, a refresh
after close opens no channel, and the link's thread ends quietly when close shut a probe's
channel under it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from openjev.frontend import worker_link
from openjev.frontend.worker_link import WorkerLink

# gRPC's connectivity thread of a channel closed while it still connects raises "Channel closed!"
# in that (daemon) thread: grpc's own. Each test waits for it (settle) so that it is ignored here
# rather than reported under the next test; the link's own thread is checked by excepthook below.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
ENDPOINTS = ["127.0.0.1:9", "127.0.0.1:10"]  # nothing listens there


def settle() -> None:
    time.sleep(0.5)  # grpc's connectivity poll wakes every 0.2 s


def make_link() -> WorkerLink:
    return WorkerLink(",".join(ENDPOINTS), fingerprint="", max_length=16384)


def test_close_while_a_refresh_adds_a_worker(monkeypatch):
    """The link's refresh runs while close() closes the probes (injected into the first probe's
    channel close) and the target now resolves to a third worker."""
    link = make_link()
    link._probes = {endpoint: worker_link._Probe(endpoint) for endpoint in ENDPOINTS}
    monkeypatch.setattr(link, "targets", SimpleNamespace(endpoints=lambda: [*ENDPOINTS, "127.0.0.1:11"]))
    first = link._probes[ENDPOINTS[0]]
    real_close = first.channel.close

    def close_during_a_refresh() -> None:
        real_close()
        link.refresh()

    first.channel.close = close_during_a_refresh  # type: ignore[method-assign]
    link.close()  # before: RuntimeError, dictionary changed size during iteration
    assert link._probes == {}  # the refresh opened nothing once close had begun
    settle()


def test_refresh_after_close_opens_no_probe():
    link = make_link()
    link.close()
    state = link.refresh()
    assert link._probes == {}
    assert state is link.state
    settle()


def test_the_link_thread_survives_close_during_its_checks(monkeypatch):
    """close() between the probes' calls: a call on a closed channel raises ValueError (not an
    RpcError), which must end the link's thread quietly, not as an unhandled exception."""
    link = make_link()
    errors: list[BaseException] = []
    thread = threading.Thread(target=link._loop, name="worker-link")

    def record(args) -> None:
        # excepthook is process-wide: grpc's connectivity thread of the channel closed here may
        # raise "Channel closed!" at the same moment (seen in CI); only the link's thread counts.
        if args.thread is thread:
            errors.append(args.exc_value)

    monkeypatch.setattr(threading, "excepthook", record)
    real_check = link._check

    def check_after_close(endpoint, probe):
        link.close()  # closes this probe's channel before its Describe
        return real_check(endpoint, probe)

    monkeypatch.setattr(link, "_check", check_after_close)
    link._wake.set()
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert errors == []
    settle()


def test_a_name_that_empties_and_returns_gets_new_channels(monkeypatch):
    """A dns:/// name whose one address vanishes (the worker restarting, its record gone) and comes
    back the same got no new channels: left to gRPC's resolver, up to 30 s. Channels are counted,
    not connected (a stand-in _Traffic); the addresses come in as the probes resolve them."""
    built = []

    class Traffic:
        def __init__(self, *args):
            built.append(self)
            self.ready = threading.Event()
            self.ready.set()

        def retire(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(worker_link, "_Traffic", Traffic)
    link = WorkerLink("dns:///worker.invalid:9", fingerprint="", max_length=16384)
    try:
        link._resolved = frozenset({"10.0.0.5:9"})
        for endpoints in (["10.0.0.5:9"], [], ["10.0.0.5:9"], ["10.0.0.6:9"]):
            link._follow(endpoints)
        assert len(built) == 1 + 2  # at start; on the address's return; on its move
    finally:
        link.close()
