"""Ephemeral client secrets for `/v1/realtime` (OpenAI's `POST /v1/realtime/client_secrets`, and its beta
`POST /v1/realtime/transcription_sessions`): a browser or phone app must not hold the server's API key, so the
app's backend mints a short-lived secret with it and hands that to the client, which connects to `/v1/realtime`
with it (`Authorization: Bearer ek_...`, or the subprotocol `openai-insecure-api-key.ek_...` a browser can send).

As OpenAI's: a secret opens any number of sessions until it expires (GA: `expires_after.seconds`, 10-7200, 600 by
default; beta: one minute unless `client_secret.expires_at.seconds` says otherwise), and a session outlives its
secret. The session configuration given at minting (checked as a `session.update` is: openai_session_config.py)
is the session's from `session.created` on, and the client may still change it. The answer carries the effective
session, as `session.created` shows it.

jaxstream's rules where OpenAI's say nothing: a secret opens WebSocket connections to `/v1/realtime` only, always in
the OpenAI dialect of the shape it was minted in (GA or beta); it cannot mint another secret or open any other
route. Sessions it opens count against the limits of the key that minted it (serving/limits.py), so a secret is
no way around `max_streams_per_key`. A server without API keys mints too (the secret then carries a session
configuration), and refuses an `ek_` key it does not know, as a client that sends one expects it to mean something.
Secrets live in this process's memory, looked up by their SHA-256 digest (never stored or logged themselves), at
most MAX_OUTSTANDING at once (429 beyond): replicas behind a load balancer do not share them, so mint on the
replica the client will connect to (or pin by client).
"""
import dataclasses
import functools
import hashlib
import math
import secrets
import time

from aiohttp import web

from jaxstream.serving import wire_json
from jaxstream.serving.auth import SECRET_PREFIX
from jaxstream.serving.http_errors import ERROR_STATUS, RequestError, check_kind, check_ready, read_json, server_state
from jaxstream.serving.openai_realtime import OpenAiRealtime
from jaxstream.serving.openai_session_config import ClientError, parse_session_update

GA_SECONDS, BETA_SECONDS = 600, 60  # OpenAI's defaults
MIN_SECONDS, MAX_SECONDS = 10, 7200
MAX_OUTSTANDING = 4096


@dataclasses.dataclass(frozen=True)
class ClientSecret:
    expires_at: float  # seconds since the epoch
    changes: dict  # the session configuration, as parse_session_update gives it
    beta: bool  # minted in the beta shape: its sessions speak the beta dialect
    owner: str  # the minting request's key (KeyLimits.key_of): whose limits its sessions count against


class ClientSecrets:
    """The live secrets of one server process."""

    def __init__(self, clock=time.time, capacity: int = MAX_OUTSTANDING):
        self._clock = clock
        self._capacity = capacity
        self._live: dict[bytes, ClientSecret] = {}

    def __len__(self) -> int:
        return len(self._live)

    def mint(self, seconds: int, changes: dict, *, beta: bool, owner: str) -> tuple[str, int]:
        """(a new secret, when it expires in whole seconds since the epoch); RequestError 429 when MAX_OUTSTANDING
        secrets are live."""
        now = self._clock()
        if len(self._live) >= self._capacity:
            self._live = {digest: secret for digest, secret in self._live.items() if secret.expires_at > now}
            if len(self._live) >= self._capacity:
                soonest = min(secret.expires_at for secret in self._live.values())
                raise RequestError(429, "rate_limit_exceeded", f"{self._capacity} client secrets are live on this "
                                   "server: wait for some to expire", retry_after=max(1, math.ceil(soonest - now)))
        value = SECRET_PREFIX + secrets.token_urlsafe(24)
        expires_at = int(now) + seconds
        self._live[_digest(value)] = ClientSecret(expires_at, changes, beta, owner)
        return value, expires_at

    def lookup(self, value: str | None) -> ClientSecret | None:
        """The live secret `value` is, else None (an expired one is forgotten)."""
        if not value or not value.startswith(SECRET_PREFIX):
            return None
        digest = _digest(value)
        secret = self._live.get(digest)
        if secret is not None and secret.expires_at <= self._clock():
            del self._live[digest]
            return None
        return secret


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def _seconds(holder, param: str, default: int) -> int:
    """The lifetime the `param` object (GA `expires_after`, beta `client_secret.expires_at`) asks for."""
    if holder is None:
        return default
    if not isinstance(holder, dict):
        raise RequestError(400, "invalid_type", f"{param} must be an object", param)
    anchor = holder.get("anchor", "created_at")
    if anchor != "created_at":
        raise RequestError(400, "invalid_value", f"{param}.anchor must be \"created_at\", got "
                           f"{wire_json.shown(anchor)}", f"{param}.anchor")
    seconds = holder.get("seconds", default)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise RequestError(400, "invalid_value", f"{param}.seconds must be a whole number from {MIN_SECONDS} to "
                           f"{MAX_SECONDS}, got {wire_json.shown(seconds)}", f"{param}.seconds")
    return seconds


def _session_view(state, changes: dict, beta: bool) -> dict:
    """The session object a connection opened with `changes` shows in its `session.created`."""
    view = OpenAiRealtime(None, state, beta=beta)
    view.transcription["model"] = state.model_id
    view.configure(changes)
    return view.session_object(beta)


async def _mint(request: web.Request, *, beta: bool) -> web.Response:
    state = server_state(request)
    try:
        check_ready(state)
        check_kind(state, "realtime")
        body = await read_json(request)
        if beta:
            expiry = body.get("client_secret")
            if expiry is not None and not isinstance(expiry, dict):
                raise RequestError(400, "invalid_type", "client_secret must be an object", "client_secret")
            seconds = _seconds((expiry or {}).get("expires_at"), "client_secret.expires_at", BETA_SECONDS)
            session = {key: value for key, value in body.items() if key not in ("client_secret", "modalities")}
        else:
            seconds = _seconds(body.get("expires_after"), "expires_after", GA_SECONDS)
            session = body.get("session")
            if session is None:
                session = {"type": "transcription"}
        try:
            changes = parse_session_update(session, beta, state)
        except ClientError as exc:
            raise RequestError(ERROR_STATUS.get(exc.code, 400), exc.code, exc.message, exc.param) from None
        value, expires_at = state.client_secrets.mint(seconds, changes, beta=beta,
                                                      owner=state.key_limits.key_of(request))
    except RequestError as exc:
        return exc.response()
    view = _session_view(state, changes, beta)
    if beta:
        return web.json_response({**view, "client_secret": {"value": value, "expires_at": expires_at}})
    return web.json_response({"value": value, "expires_at": expires_at, "session": view})


def add_client_secret_routes(app: web.Application) -> None:
    app.router.add_post("/v1/realtime/client_secrets", functools.partial(_mint, beta=False))
    app.router.add_post("/v1/realtime/transcription_sessions", functools.partial(_mint, beta=True))
