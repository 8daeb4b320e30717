"""API-key check for every route except health and metrics, before any WebSocket upgrade.

A key is accepted as `Authorization: Bearer K` (OpenAI and vLLM clients), `X-API-Key: K` or `?api_key=K`
(the `/ws` conventions), or as the WebSocket subprotocol `openai-insecure-api-key.K` (OpenAI's browser
clients: a browser's WebSocket can set no header but `Sec-WebSocket-Protocol`). A failure is HTTP 401 before the
upgrade, as vLLM does, so a WebSocket client sees it as a refused handshake. Keys are compared in
constant time. An ephemeral client secret (`ek_...`, serving/client_secrets.py) is a key for `/v1/realtime` alone.
"""
import hmac
import logging
import os
from pathlib import Path

from aiohttp import web

from jaxstream.errors import UserError
from jaxstream.serving.http_errors import error_response

logger = logging.getLogger(__name__)

# Liveness probes (load balancers, SageMaker, Kubernetes) and Prometheus scrapers carry no key; vLLM
# leaves /health and /metrics open too.
OPEN_PATHS = frozenset({"/health", "/healthz", "/ping", "/metrics"})


def load_api_keys(cli_key: str | None = None, key_file: str | None = None, environ=os.environ) -> tuple[str, ...]:
    """The accepted keys: `--api-key`, else every non-empty line of `--api-key-file`, else
    $JAXSTREAM_API_KEY. Empty: no auth."""
    if cli_key is not None and key_file is not None:
        raise UserError("give --api-key or --api-key-file, not both")
    if cli_key is not None:
        keys = [cli_key]
    elif key_file is not None:
        try:
            keys = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise UserError(f"cannot read --api-key-file {key_file}: {exc.strerror or exc}") from None
    else:
        keys = [environ.get("JAXSTREAM_API_KEY", "")]
    keys = tuple(k.strip() for k in keys if k.strip())
    if (cli_key is not None or key_file is not None) and not keys:
        raise UserError("the API key is empty")
    return keys


KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
SECRET_PREFIX = "ek_"  # an ephemeral client secret's (OpenAI's form)
REALTIME_PATH = "/v1/realtime"  # the one route a client secret opens
# The request's entry for the client secret that authenticated it: resolved once, so the limits and the handler
# see the secret the check saw even if it expires in between. A typed key from aiohttp 3.13 (a plain name warns
# there), a plain name before it (setup.cfg allows 3.9).
CLIENT_SECRET = (web.RequestKey("jaxstream_client_secret", object) if hasattr(web, "RequestKey")
                 else "jaxstream_client_secret")


def offered_subprotocols(request: web.Request) -> list[str]:
    """The WebSocket subprotocols a handshake offers, in the client's order (the header may repeat)."""
    return [name.strip() for header in request.headers.getall("Sec-WebSocket-Protocol", ())
            for name in header.split(",") if name.strip()]


def presented_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    # `kyutai-api-key` / `?auth_id=`: how Kyutai's STT clients present theirs (kyutai.py).
    key = (request.headers.get("X-API-Key") or request.query.get("api_key")
           or request.headers.get("kyutai-api-key") or request.query.get("auth_id"))
    if key:
        return key
    # Never selected, so never echoed: the handshake's answer names `realtime`, `openai-beta.realtime-v1` or
    # `vllm-realtime` (realtime_dialects.py).
    return next((name.removeprefix(KEY_SUBPROTOCOL_PREFIX) for name in offered_subprotocols(request)
                 if name.startswith(KEY_SUBPROTOCOL_PREFIX) and len(name) > len(KEY_SUBPROTOCOL_PREFIX)), None)


def is_authorized(request: web.Request, keys: tuple[str, ...]) -> bool:
    if not keys:
        return True
    key = presented_key(request)
    if key is None:
        return False
    given = key.encode()
    # Compare against every key (no early exit) so the timing does not say which key nearly matched.
    return sum(hmac.compare_digest(given, k.encode()) for k in keys) > 0


def auth_middleware(keys: tuple[str, ...], open_paths=OPEN_PATHS, client_secrets=None):
    """Refuses every request but those to `open_paths` without a valid key (401 before any upgrade). A live client
    secret of `client_secrets` (serving/client_secrets.py) is a key for `/v1/realtime` alone; one that is not live
    is refused there even when the server has no keys; a live one is the request's `CLIENT_SECRET`."""
    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.path in open_paths or (keys and is_authorized(request, keys)):
            return await handler(request)
        key = presented_key(request)
        if client_secrets is not None and key is not None and key.startswith(SECRET_PREFIX):
            if request.path != REALTIME_PATH:
                return _refused(request, "A client secret opens /v1/realtime connections only: use an API key")
            secret = client_secrets.lookup(key)
            if secret is None:
                return _refused(request, "The client secret is invalid or has expired")
            request[CLIENT_SECRET] = secret
            return await handler(request)
        if keys:
            return _refused(request, "Missing or invalid API key")
        return await handler(request)

    return check_api_key


def _refused(request: web.Request, message: str) -> web.Response:
    logger.info("refused %s %s from %s: %s", request.method, request.path, request.remote, message)
    # OpenAI's own answer to a bad key: 401, code invalid_api_key, type invalid_request_error.
    response = error_response(401, "invalid_api_key", message)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response
