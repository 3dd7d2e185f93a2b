"""Every gRPC core option the servers and the frontend's channels set is one grpcio's core knows:
grpcio ignores an unknown name without a word. A misspelled ping-interval option left the workers
at gRPC's 5-minute default, so they answered the frontend's 10 s keepalive pings with GOAWAY
`too_many_pings` after ~30 s, and every worker call longer than that failed UNAVAILABLE."""

from __future__ import annotations

from pathlib import Path

import grpc._cython.cygrpc as cygrpc

from openjev import serving
from openjev.frontend import worker_link

CORE = Path(cygrpc.__file__).read_bytes()  # the option names are strings in grpcio's core


def test_every_option_name_is_known_to_grpc_core():
    lists = {
        "server": serving.server_options(serving.MAX_MESSAGE_BYTES, max_connection_age_seconds=60.0),
        "channel": serving.channel_options(),
        "traffic": worker_link.traffic_channel_options(),
        "affinity": worker_link.affinity_channel_options(),
        "liveness": serving.liveness_options(),
    }
    unknown = {where: [name for name, _ in options if name.encode() not in CORE] for where, options in lists.items()}
    assert unknown == {where: [] for where in lists}
    assert b"grpc.no_such_option_ms" not in CORE  # the check can fail
