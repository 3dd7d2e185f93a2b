"""uvicorn's h11 protocol with two guards it lacks: a deadline for each request's head, and a cap
on open connections.

Without them a client that sends half a request head (or nothing) keeps its connection for good:
1,010 such TLS connections took a frontend's file descriptors, and with them its gRPC port and its
connection to the worker (a review, 2026-12-01). The body has its own deadline in the route
(`app.BODY_SECONDS`); uvicorn closes idle keep-alive connections itself."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_SECONDS = 10.0  # from a connection's start, or a later head's first bytes, to the whole head
MAX_CONNECTIONS = 512  # of this port; more are closed at once


class GuardedH11Protocol(H11Protocol):
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # waiting for (the rest of) a request's head
            if self._head_timer is None:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_SECONDS, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
