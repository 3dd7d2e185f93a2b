"""uvicorn on a thread of the frontend process: started beside the gRPC server, drained with it.

uvicorn's own h11 server and asyncio loop (no optional C extensions), no signal handlers (it
runs off the main thread, where `openjev.serving` owns SIGTERM), no access log (the route logs
one line per request like the gRPC path)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time

import uvicorn

from openjev import logs
from openjev.frontend.http import guard
from openjev.frontend.http.app import HttpApi
from openjev.frontend.http.guard import UVICORN_MALFORMED, GuardedH11Protocol


def _bind(listen: str) -> socket.socket:
    """A bound socket for HOST:PORT ([v6]:PORT; port 0 picks one), checked as --http-listen
    (config.host_port)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        raise SystemExit(f"openjev-frontend: cannot listen on {listen} for HTTP: {error}") from error
    return sock


class HttpServer:
    """uvicorn's own start/stop lines are plain text among our JSON lines: only its warnings
    and errors are kept; the frontend logs its HTTP port itself."""

    def __init__(
        self,
        api: HttpApi,
        listen: str,
        *,
        grace_seconds: float,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
    ):
        """tls_*: as the gRPC port's (PEM files); a client CA makes client certificates required."""
        self._api = api
        self._socket = _bind(listen)
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            api.app,
            http=GuardedH11Protocol,  # h11 with a head deadline and a connection cap (guard.py)
            loop="asyncio",
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=grace_seconds,  # type: ignore[arg-type]  # a float works (wait_for)
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            ssl_ca_certs=tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
        )
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.setLevel(logging.WARNING)
        # its warnings come from what clients send (junk, websocket upgrades): each at most once a second
        if not any(isinstance(f, logs.ThrottledLines) for f in uvicorn_log.filters):
            uvicorn_log.addFilter(logs.ThrottledLines(replaced=frozenset({UVICORN_MALFORMED})))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        # On a TLS port the guard's head deadline starts only once the handshake is done: a
        # connection that never sends its ClientHello was held for asyncio's 60 s, so silent
        # connections piled up to the process's file descriptor limit again. uvicorn passes no
        # handshake timeout, so this loop's create_server gets the head deadline as one.
        loop = asyncio.get_running_loop()
        create_server = loop.create_server

        def with_handshake_deadline(*args, **kwargs):
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_handshake_timeout", guard.HEAD_SECONDS)
            return create_server(*args, **kwargs)

        loop.create_server = with_handshake_deadline  # type: ignore[method-assign]
        await self._server.serve(sockets=[self._socket])

    def start(self, timeout_seconds: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_seconds
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise SystemExit("the HTTP server did not start")
            time.sleep(0.01)

    def begin_stop(self) -> None:
        """Stop accepting; requests in flight go on (up to the grace period)."""
        self._api.draining = True
        self._server.should_exit = True

    def wait_stopped(self) -> None:
        self.begin_stop()
        self._thread.join()
        self._api.close()
