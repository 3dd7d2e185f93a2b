"""TLS for both servers, mutual TLS between frontend and worker, bearer tokens on the public API.

Certificates and keys are PEM files named by flags (`--tls-cert`, `--tls-key`, `--tls-client-ca`
on a server; `--worker-tls-ca`, `--worker-tls-cert`, `--worker-tls-key` on the frontend's worker
channels), each also an `OPENJEV_*` variable like every flag. A server given `--tls-client-ca`
requires client certificates signed by it (mutual TLS). A link without certificates (a server's
port, the frontend's connection to its workers) is plaintext only when asked for with
`--plaintext` (`OPENJEV_PLAINTEXT=1`), and then logs a warning; otherwise the program refuses to
start with one line naming the flags (`require_tls`).

Bearer tokens: `--auth-token-file` (one token a line; blank lines and `#` comments skipped) and/or
the `OPENJEV_AUTH_TOKENS` variable (comma-separated). When any token is configured, every call of
the public API must carry `authorization: Bearer <token>` matching one of them, compared in
constant time, else UNAUTHENTICATED. Health and reflection stay open (probes carry no tokens).
Tokens are never logged: the flag holds a path, and the config log redacts it too.
"""

from __future__ import annotations

import hmac
import os
import ssl
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

from openjev import logs
from openjev.interceptors import REQUEST_ID_KEY, valid_request_id

log = logs.get("openjev.security")

AUTH_TOKENS_ENV = "OPENJEV_AUTH_TOKENS"
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
SHORT_TOKEN_CHARS = 16  # shorter bearer tokens are accepted with a warning at start
# Callable without a token: probes and schema discovery.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.")


class SecurityError(ValueError):
    """A certificate, key or token source that cannot be used (the message names the file)."""


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise SecurityError(f"cannot read {what} {path}: {error.strerror}") from None
    if not data.strip():
        raise SecurityError(f"{what} {path} is empty")
    return data


def _check_pair(cert: Path, key: Path, flags: str) -> None:
    """The certificate and key are PEM and belong together (gRPC finds out only when the port is
    bound, after the worker has loaded its weights, and then says the address is in use)."""
    try:  # an encrypted key gets an empty password (never a prompt): gRPC cannot use one either
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as error:
        reason = error.reason or "unreadable"  # an encrypted key's error has no reason
        try:
            if b"ENCRYPTED" in key.read_bytes():  # PKCS#8's BEGIN ENCRYPTED, or the old Proc-Type
                reason = "the key is encrypted"
        except OSError:
            pass
        raise SecurityError(
            f"{flags} {cert} and {key}: not a PEM certificate and its unencrypted private key ({reason})"
        ) from None


def _check_ca(ca: Path, flag: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
    except ssl.SSLError as error:
        reason = error.reason or "unreadable"  # a PEM block whose body is no certificate has none
        raise SecurityError(f"{flag} {ca}: not a PEM CA certificate ({reason})") from None


def _check_client_files(ca: Path, cert: Path | None, key: Path | None, ca_flag: str, pair_flags: str) -> None:
    _check_ca(ca, ca_flag)
    if cert is not None and key is not None:
        _check_pair(cert, key, pair_flags)


def server_credentials(cert: Path | None, key: Path | None, client_ca: Path | None) -> grpc.ServerCredentials | None:
    """None (plaintext) when no certificate is given; mutual TLS when client_ca is."""
    if cert is None and key is None:
        if client_ca is not None:
            raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise SecurityError("--tls-cert and --tls-key go together")
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    ca = _read(client_ca, "client CA")
    _check_pair(cert, key, "--tls-cert/--tls-key")
    if client_ca is not None:
        _check_ca(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(
    ca: Path | None, cert: Path | None, key: Path | None, server_name: str | None = None
) -> grpc.ChannelCredentials | None:
    """None (plaintext) when no CA is given; a client certificate when cert and key are.
    server_name: only checked here (a name for certificates on a plaintext link was ignored)."""
    if ca is None:
        if cert is not None or key is not None or server_name is not None:
            raise SecurityError("--worker-tls-cert, --worker-tls-key and --worker-tls-server-name need --worker-tls-ca")
        return None
    if (cert is None) != (key is None):
        raise SecurityError("--worker-tls-cert and --worker-tls-key go together")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "worker CA"),
        private_key=_read(key, "client key"),
        certificate_chain=_read(cert, "client certificate"),
    )
    # a bad CA left the frontend NOT_SERVING for good, unexplained
    _check_client_files(ca, cert, key, "--worker-tls-ca", "--worker-tls-cert/--worker-tls-key")
    return credentials


def add_client_tls_arguments(p, server: str) -> None:
    """A client tool's TLS flags (`server`: what it calls, for the help): --tls-ca, --tls-cert,
    --tls-key, --tls-server-name; client_tls reads them."""
    p.add_argument("--tls-ca", type=Path, metavar="CA.pem", help="TLS, trusting this CA (PEM); default plaintext")
    p.add_argument(
        "--tls-cert", type=Path, metavar="CERT.pem", help=f"client certificate, for a {server} that requires one (mTLS)"
    )
    p.add_argument("--tls-key", type=Path, metavar="KEY.pem", help="PEM private key of --tls-cert")
    name_help = f"the name the {server}'s certificate carries, if not the address"
    p.add_argument("--tls-server-name", metavar="NAME", help=name_help)


def client_tls(args, usage_error: Callable[[str], object], read: Callable[[Path, str], bytes]):
    """(credentials or None for plaintext, channel options) from add_client_tls_arguments' flags.
    usage_error: refuses a combination of flags; read(path, what): a file's bytes, or the tool's
    own way of failing."""
    if args.tls_ca is None and (args.tls_cert or args.tls_key or args.tls_server_name):
        usage_error("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
    if (args.tls_cert is None) != (args.tls_key is None):
        usage_error("--tls-cert and --tls-key go together")
    if args.tls_ca is None:
        return None, []
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca, "CA"),
        private_key=None if args.tls_key is None else read(args.tls_key, "TLS key"),
        certificate_chain=None if args.tls_cert is None else read(args.tls_cert, "TLS certificate"),
    )
    try:  # gRPC says only "Failed to create security handshaker" for files it cannot use
        _check_client_files(args.tls_ca, args.tls_cert, args.tls_key, "--tls-ca", "--tls-cert/--tls-key")
    except SecurityError as error:
        usage_error(str(error))
    options = [] if args.tls_server_name is None else [("grpc.ssl_target_name_override", args.tls_server_name)]
    return credentials, options


def require_tls(credentials: object | None, *, plaintext: bool, link: str, flags: str) -> None:
    """Refuse a link without TLS unless plaintext was asked for. link: what would be plaintext
    ("the public port"); flags: the certificate flags that would give it TLS."""
    if credentials is None and not plaintext:
        raise SecurityError(
            f"{link} has no TLS certificate (set {flags}); pass --plaintext (or OPENJEV_PLAINTEXT=1) "
            "to run it in plaintext"
        )


HEADER_BLANKS = " \t\r"  # what may surround a token: spaces, tabs, a CRLF line's CR


def load_tokens(token_file: Path | None, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    env: Mapping[str, str] = os.environ if environ is None else environ
    tokens: list[tuple[str, str]] = []  # (where it was given, token)
    if token_file is not None:
        text = _read(token_file, "auth token file")
        assert text is not None
        try:
            # lines end at "\n" only (splitlines also cut at VT, FF, FS, NEL ...: a stray one split
            # a token into shorter ones, each accepted); a Windows editor's BOM and CRs are dropped
            lines = text.decode("utf-8-sig").split("\n")
            stripped = (line.strip(HEADER_BLANKS) for line in lines)
            tokens += [(f"auth token file {token_file}", t) for t in stripped if not t.startswith("#")]
        except UnicodeDecodeError:
            raise SecurityError(f"auth token file {token_file}: not UTF-8 text") from None
    given = env.get(AUTH_TOKENS_ENV)
    tokens += [(f"${AUTH_TOKENS_ENV}", part.strip(HEADER_BLANKS)) for part in (given or "").split(",")]
    # `#` comments are the file's only: a variable's token that starts with `#` is a token
    kept = [(where, t) for where, t in tokens if t]
    if not kept and (token_file is not None or (given or "").strip()):
        # tokens were asked for: none would mean an open port, and nobody would be told
        source = f"auth token file {token_file}" if token_file is not None else f"${AUTH_TOKENS_ENV}"
        raise SecurityError(f"{source} holds no token (only blank lines, separators or # comments)")
    for where, token in kept:
        # a token travels in a header (HTTP's read as latin-1, gRPC's ASCII only): with any other
        # character it is a token no client can present (the token itself is not shown)
        if not all(" " <= c <= "~" for c in token):
            number = [t for w, t in kept if w == where].index(token) + 1
            raise SecurityError(f"{where}: token {number} has characters other than printable ASCII")
    return tuple(t.encode("ascii") for _, t in kept)


class BearerAuth(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries one of `tokens` (health and reflection are open)."""

    def __init__(self, tokens: tuple[bytes, ...]):
        if not tokens:
            raise ValueError("BearerAuth needs at least one token")
        self._tokens = tokens

    def _allowed(self, metadata) -> bool:
        return self.allowed_headers([value for key, value in metadata or () if key == "authorization"])

    def allowed_headers(self, values: list[str]) -> bool:
        """Whether a call's `authorization` headers are exactly one carrying a token. Two are
        refused: a proxy that checked one of them and this server would not agree on which."""
        return len(values) == 1 and self.allowed(values[0])

    def allowed(self, header: str) -> bool:
        """Whether an `authorization` header value carries one of the tokens."""
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return False
        # HTTP's blanks only: str.strip() also took NBSP, NEL and FS..US (latin-1 header bytes)
        # around a token, which a proxy comparing the header exactly would not accept
        given = presented.strip(HEADER_BLANKS).encode("utf-8")
        # Every token compared, each in constant time: the time says nothing about which matched.
        matches = [hmac.compare_digest(given, token) for token in self._tokens]
        return any(matches)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler

        method = handler_call_details.method

        def refuse(request, context):
            # the request id the interceptors gave the call (Decide's: its own, or one made up), as
            # Decide returns it: a refused caller can quote it too. Other methods pass no
            # interceptor that checks or makes one, so the same rule applies here.
            request_id = dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY)
            if not isinstance(request_id, str) or not valid_request_id(request_id):
                request_id = uuid.uuid4().hex
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            # logged as the HTTP route logs its 401s (token guessing over gRPC left no trail), with
            # the peer: whom to block
            log.info(
                "refused",
                status="UNAUTHENTICATED",
                method=method,
                request_id=request_id,
                peer=context.peer(),
                transport="grpc",
            )
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        def refuse_stream(request_iterator, context):
            refuse(None, context)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse_stream)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
