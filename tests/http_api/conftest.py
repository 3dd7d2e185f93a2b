"""A real worker + frontend pair with the HTTP API on, on loopback, and an HTTP client of it."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

# tests/test_security.py's certificates (a CA, another one, a server and a client leaf of each),
# for the HTTP port's TLS
from test_security import pki  # noqa: F401  (a fixture)

from openjev.tools import launch

# Small, so that 413 is cheap to provoke; every request the tests send fits.
MAX_BODY_BYTES = 1 << 20


@dataclass
class HttpPair:
    pair: launch.Pair
    url: str

    @property
    def grpc_address(self) -> str:
        return self.pair.frontend.address


def start_http_pair(model, workdir, *, worker_args=(), frontend_args=()) -> HttpPair:
    port = launch.free_port()
    pair = launch.start_pair(
        model,
        workdir,
        worker_args=list(worker_args),
        frontend_args=[
            "--http-listen",
            f"127.0.0.1:{port}",
            "--http-max-body-bytes",
            str(MAX_BODY_BYTES),
            "--http-metrics",  # the tests count outcomes there
            *frontend_args,
        ],
    )
    return HttpPair(pair, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="session")
def http_pair_factory():
    """start_http_pair, for tests that need a pair of their own (other worker flags)."""
    return start_http_pair


@pytest.fixture(scope="session")
def max_body_bytes() -> int:
    return MAX_BODY_BYTES


@pytest.fixture(scope="module")
def http_pair(demo_model, tmp_path_factory):
    started = start_http_pair(demo_model, tmp_path_factory.mktemp("http"))
    yield started
    started.pair.stop()


@pytest.fixture(scope="module")
def http(http_pair):
    with httpx.Client(base_url=http_pair.url, timeout=120) as client:
        yield client
