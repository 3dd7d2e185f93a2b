"""`--worker`: one or many workers as a gRPC target, and the individual workers behind it.

Accepted forms:
- `HOST:PORT`                     one worker (HOST may be a name: resolved by gRPC's DNS resolver)
- `IP1:P1,IP2:P2,...`              a fixed set of workers, IP literals only (names change; use DNS)
- `ipv4:IP1:P1,...`, `ipv6:[..]:P,...`  the same in gRPC's own syntax
- `dns:///NAME:PORT`               every address NAME resolves to (compose service, Kubernetes
                                  headless service), resolved again each refresh (worker_link)

Traffic goes to `traffic_target`, balanced by gRPC's round_robin or ring_hash (worker_link). The
frontend also talks to each worker (`endpoints()`) on its own, to check it is compatible
before traffic depends on it.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
from dataclasses import dataclass

from openjev import config


class TargetError(ValueError):
    pass


# A DNS name (compose service names may hold `_`). Anything else that is no IP literal, such as
# `dns://AUTHORITY/NAME` or `DNS:///NAME`, would reach gRPC as a target that never resolves.
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _split_host_port(address: str) -> tuple[str, int]:
    try:  # the host is checked below (a bare IPv6 address is taken, as gRPC's ipv6: lists take it)
        config.with_port(address, lowest=1)
    except argparse.ArgumentTypeError:
        raise TargetError(f"worker address {address!r} is not HOST:PORT (a port 1-65535)") from None
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    # a name's labels are 1-63 characters (the resolver's IDNA codec raised on others, a traceback)
    labels = host.removesuffix(".").split(".")
    if _ip_version(host) is None and not (_NAME.fullmatch(host) and all(0 < len(x) <= 63 for x in labels)):
        raise TargetError(
            f"worker address {address!r}: {host!r} is not a host name or IP address "
            "(forms: HOST:PORT, IP:PORT,IP:PORT,..., ipv4:/ipv6: lists, dns:///NAME:PORT)"
        )
    return host, int(port)


def _ip_version(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if _ip_version(host) == 6 else f"{host}:{port}"


@dataclass(frozen=True)
class WorkerTargets:
    """traffic_target: the gRPC target of the load-balanced traffic channel.
    fixed: the workers of an IP list (None: resolve `name`:`port` each time)."""

    text: str
    traffic_target: str
    fixed: tuple[str, ...] | None
    name: str = ""
    port: int = 0

    def endpoints(self) -> list[str] | None:
        """Each worker's own HOST:PORT now; None where the name's lookup failed (does not resolve,
        or not now)."""
        if self.fixed is not None:
            return list(self.fixed)
        try:
            infos = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return None
        return sorted({_endpoint(str(info[4][0]), self.port) for info in infos})


def parse_worker_targets(text: str) -> WorkerTargets:
    text = text.strip()
    if not text:
        raise TargetError("empty")
    if text.startswith("dns://") and not text.startswith("dns:///"):
        raise TargetError(f"{text!r}: a DNS server (dns://AUTHORITY/) is not supported; use dns:///NAME:PORT")
    for scheme in ("dns:///", "dns:"):
        if text.startswith(scheme):
            host, port = _split_host_port(text[len(scheme) :])
            return WorkerTargets(text, f"dns:///{_endpoint(host, port)}", None, host, port)
    listed = text
    for scheme in ("ipv4:", "ipv6:"):
        if text.startswith(scheme):
            listed = text[len(scheme) :]
    addresses = [a.strip() for a in listed.split(",") if a.strip()]
    if not addresses:
        raise TargetError(f"{text!r}: no worker address")
    parsed = [_split_host_port(a) for a in addresses]
    versions = {_ip_version(host) for host, _ in parsed}
    if len(parsed) == 1 and versions == {None}:
        host, port = parsed[0]
        return WorkerTargets(text, f"dns:///{host}:{port}", None, host, port)
    if None in versions:
        raise TargetError(
            f"{text!r}: a list of workers must use IP addresses; "
            "for names use one dns:///NAME:PORT that resolves to all of them"
        )
    if len(versions) != 1:
        raise TargetError(f"{text!r}: do not mix IPv4 and IPv6 addresses")
    endpoints = tuple(_endpoint(host, port) for host, port in parsed)
    workers = [(ipaddress.ip_address(host), port) for host, port in parsed]  # [::1] is [0::1]
    twice = sorted({e for e, w in zip(endpoints, workers, strict=True) if workers.count(w) > 1})
    if twice:  # round robin would send such a worker twice its share
        raise TargetError(f"{text!r}: the same worker listed twice ({', '.join(twice)})")
    scheme = "ipv6" if versions == {6} else "ipv4"
    return WorkerTargets(text, f"{scheme}:{','.join(endpoints)}", endpoints)
