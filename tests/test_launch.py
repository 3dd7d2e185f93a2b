"""The launch helpers' ports: a server restarted on its address must find that address free."""

from __future__ import annotations

import socket

import pytest

from openjev.tools import launch


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """Below the range the kernel hands to outgoing connections, which took a port between
    free_port and the worker's bind in a loaded CI run (`Address already in use`); drawn at
    random, so that two test processes do not pick the same one."""
    ephemeral = launch.ephemeral_ports()
    if ephemeral.start - launch.FIXED_PORTS_FROM < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {ephemeral.start}")
    ports = [launch.free_port() for _ in range(20)]
    assert all(launch.FIXED_PORTS_FROM <= port < ephemeral.start for port in ports), ports
    assert len(set(ports)) > 1, ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", ports[0]))
        server.listen()
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5):
            pass
