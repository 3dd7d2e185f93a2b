"""The process that parses large request bodies for the frontend (`parsing.BodyParsers`):
`python -m openjev.frontend.parse_child FD`, FD its end of a socket pair.

Its own small entry, not a multiprocessing child: a spawned child imports its parent's main
module first, and the frontend's (gRPC, the HTTP server, the tokenizer) made a child of ~50 MiB
(and a resource tracker of ~12) where this one is ~20 (docs/reliability.md). The first message
is the parse function (pickled); then a body in, (True, compiled request) or (False, the
exception) out, until the frontend closes its end.
"""

from __future__ import annotations

import pickle
import signal
import sys
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    try:
        parse = conn.recv()
    except (EOFError, OSError):
        return
    while True:
        try:
            body = conn.recv()
        except (EOFError, OSError):  # the frontend closed the pipe, or is gone
            return
        try:
            reply: tuple[bool, object] = (True, parse(body))
        except Exception as error:  # ContractError, or what the frontend's own process would have raised
            reply = (False, error)
        del body
        try:
            try:
                conn.send(reply)
            except (TypeError, AttributeError, pickle.PicklingError) as error:  # an exception that does not pickle
                conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}; not sent: {error}")))
        except OSError:  # the frontend is gone
            return
        del reply  # an idle child holds no compiled request


def main() -> None:
    # The frontend decides when its children end (it kills them when it stops; an idle one exits
    # when the pipe closes): a signal to the whole process group, as service managers send, must
    # not take them while the frontend drains.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
