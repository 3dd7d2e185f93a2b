"""uvicorn's h11 protocol with the guards it lacks: a deadline for each request's head, one for
its body, and a cap on open connections; and its 400 for a request h11 cannot parse in the
route's error format (JSON, a request id) instead of uvicorn's plain text.

Without them a client that sends half a request head (or nothing) keeps its connection for good:
1,010 such TLS connections took a frontend's file descriptors, and with them its gRPC port and its
connection to the worker (a review, 2026-12-01). So did one that declared a body to a route that
answers without reading it (GET /health with a content-length) and then sent a byte: uvicorn
cancels its keep-alive timer on that byte and never sets it again (a review, 2026-12-03). The
decision route reads its body within `app.BODY_SECONDS` and answers 408 itself; the body deadline
here is later, for every other route. uvicorn closes idle keep-alive connections itself."""

from __future__ import annotations

import asyncio
import json
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from openjev import logs

HEAD_SECONDS = 10.0  # from a connection's start, or a later head's first bytes, to the whole head
BODY_SECONDS = 70.0  # from a head's end to its body's end (the decision route's 408 comes at 60 s)
MAX_CONNECTIONS = 512  # of this port; more are closed at once
# uvicorn's own line for a request h11 cannot parse; `http_malformed` replaces it (server.py)
UVICORN_MALFORMED = "Invalid HTTP request received."

log = logs.get("openjev.frontend.http")
_malformed = logs.Throttle()  # junk is free to send: one line a second, the rest counted


class GuardedH11Protocol(H11Protocol):
    _timer: asyncio.TimerHandle | None = None
    _timed: type[h11.IDLE] | type[h11.SEND_BODY] | None = None  # the client's state the timer is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            transport.close()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may parse a pipelined request: its body is watched too
        self._watch(head=False)  # an idle connection is uvicorn's keep-alive timer's

    def send_400_response(self, msg: str) -> None:
        request_id = uuid.uuid4().hex  # the request's own could not be read
        under_way = self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE)  # a response: only closing is left
        dropped = _malformed.admit("malformed")
        if dropped is not None:
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else None
            status = None if under_way else 400  # None: the connection closed, no answer
            log.warning("http_malformed", peer=peer, request_id=request_id, dropped=dropped, status=status)
        if under_way:
            self.transport.close()
            return
        body = json.dumps({"error": "malformed HTTP request"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"x-request-id", request_id.encode()),
        ]
        response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self, head: bool = True) -> None:
        """A deadline while the client owes a head (IDLE: from its first bytes) or a body
        (SEND_BODY), not moved by the bytes that trickle in; none otherwise."""
        state = self.conn.their_state
        if state is self._timed:
            return
        self._disarm()
        if (state is h11.IDLE and head) or state is h11.SEND_BODY:
            self._timed = state
            seconds = HEAD_SECONDS if state is h11.IDLE else BODY_SECONDS
            self._timer = self.loop.call_later(seconds, self._late, state)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timed = None

    def _late(self, state) -> None:
        self._timer = self._timed = None
        if self.conn.their_state is state and not self.transport.is_closing():
            self.transport.close()
