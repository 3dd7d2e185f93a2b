"""`--worker` forms: the traffic target gRPC balances over, and the workers described one by one."""

from __future__ import annotations

import pytest

from openjev.frontend.worker_targets import TargetError, parse_worker_targets


@pytest.mark.parametrize(
    "text,traffic,fixed",
    [
        ("127.0.0.1:50052", "ipv4:127.0.0.1:50052", ["127.0.0.1:50052"]),
        ("127.0.0.1:1, 127.0.0.1:2", "ipv4:127.0.0.1:1,127.0.0.1:2", ["127.0.0.1:1", "127.0.0.1:2"]),
        ("ipv4:10.0.0.1:5,10.0.0.2:5", "ipv4:10.0.0.1:5,10.0.0.2:5", ["10.0.0.1:5", "10.0.0.2:5"]),
        ("[::1]:7,[::2]:7", "ipv6:[::1]:7,[::2]:7", ["[::1]:7", "[::2]:7"]),
        # bare IPv6 addresses: their port after the last colon (a stricter HOST:PORT once refused them)
        ("::1:50052", "ipv6:[::1]:50052", ["[::1]:50052"]),
        ("ipv6:::1:7,fe80::1:8", "ipv6:[::1]:7,[fe80::1]:8", ["[::1]:7", "[fe80::1]:8"]),
    ],
)
def test_fixed_lists(text, traffic, fixed):
    targets = parse_worker_targets(text)
    assert targets.traffic_target == traffic
    assert targets.endpoints() == fixed


@pytest.mark.parametrize("text", ["dns:///localhost:50052", "dns:localhost:50052", "localhost:50052"])
def test_names_resolve_to_every_address(text):
    targets = parse_worker_targets(text)
    assert targets.traffic_target == "dns:///localhost:50052"
    assert targets.endpoints() and all(e.endswith(":50052") for e in targets.endpoints())


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "^empty$"),
        ("host-a:1,host-b:1", "a list of workers must use IP addresses"),
        ("127.0.0.1:1,[::1]:1", "do not mix IPv4 and IPv6 addresses"),
        (" , ", "^',': no worker address$"),
        ("ipv4:", "^'ipv4:': no worker address$"),
        ("127.0.0.1:1,127.0.0.2:1,127.0.0.1:1", r"the same worker listed twice \(127\.0\.0\.1:1\)$"),
        ("[::1]:7,[0:0::1]:7", r"the same worker listed twice \(\[0:0::1\]:7, \[::1\]:7\)$"),
        ("127.0.0.1", r"is not HOST:PORT \(a port 1-65535\)"),
        ("dns:///x", r"'x' is not HOST:PORT"),
        ("dns://1.2.3.4/x:1", r"a DNS server \(dns://AUTHORITY/\) is not supported"),
    ],
)
def test_refused(text, why):
    with pytest.raises(TargetError, match=why):
        parse_worker_targets(text)
