"""The HTTP/JSON API of the frontend (`--http-listen`), served in the same process as the gRPC API."""
