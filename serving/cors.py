"""Cross-origin requests (CORS): a page served from another origin (another port, an app using OpenAI's JS SDK, a
custom UI) may call the HTTP API from a browser, as vLLM's OpenAI server allows with Starlette's CORSMiddleware and
its flags `--allowed-origins`, `--allowed-methods`, `--allowed-headers` (each a JSON list, default ["*"]) and
`--allow-credentials` (default off); ServerConfig holds them.

What Starlette does, and so this: a request without an `Origin` header gets no CORS header. A preflight (OPTIONS
with `Origin` and `Access-Control-Request-Method`) is answered here, on any path, known or not, before the API key
is checked (a browser sends a preflight without credentials): 200 with the allowed methods, the request's headers
mirrored back when every header is allowed, `Access-Control-Max-Age: 600`; 400 when the origin, method or headers
are not allowed. Every other answer to an allowed origin, errors and event streams included, carries
`Access-Control-Allow-Origin`: "*" when every origin is allowed, else the page's own origin with `Vary: Origin`.
Three differences, each for a browser's sake: with credentials the origin is echoed on every answer, not only on
requests that carry a cookie (a browser refuses "*" on any credentialed request, cookie or not); the headers a
client reads (Retry-After on a 429/503, ...) are exposed, which a browser hides otherwise; and `Vary: Origin` goes
on the answers to refused origins too, so that a cache never hands their header-less answer to an allowed page.

Why not aiohttp-cors (0.8.1 installs and runs on aiohttp 3.14): its preflight is an OPTIONS route added to each
resource, so it runs after the API-key check (a preflight carries no key: 401) and the per-key rate limit, and a
preflight to an unknown path gets the router's 404; it always echoes the origin (never "*", and no `Vary: Origin`);
it answers a refused preflight 403. Matching vLLM would mean working around most of it.
"""
import logging
import re

from aiohttp import web

from jaxstream.serving.http_errors import error_response
from jaxstream.serving.http_sessions import REPLICA_HEADER

logger = logging.getLogger(__name__)

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what "*" allows, as Starlette
# Request headers a browser sends without asking (the CORS-safelisted ones); always allowed.
SAFELISTED_HEADERS = frozenset({"Accept", "Accept-Language", "Content-Language", "Content-Type"})
# Response headers a client of this server reads that a browser hides unless exposed: when to retry (429, 503), the
# auth scheme (401), the methods a route takes (405), the replica that holds a Mode B session (http_sessions.py).
EXPOSED_HEADERS = ("Retry-After", "WWW-Authenticate", "Allow", REPLICA_HEADER)
MAX_AGE_S = 600  # how long a browser may cache a preflight's answer (Starlette's default, which vLLM keeps)
# What a browser sends as `Origin`: scheme://host[:port], no path (a trailing slash never matches), or "null".
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+|null|\*")


def check_origins(origins) -> None:
    """ValueError for an entry that no browser's `Origin` header can equal (a path, a trailing slash)."""
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            raise ValueError(f"allowed origin {origin!r} can never match: a browser sends scheme://host[:port], "
                             "with no path or trailing slash (or \"*\" for any origin)")


class Cors:
    """The CORS policy of ServerConfig: `middleware` answers preflights; `on_response_prepare` (an aiohttp
    signal, so that it also reaches answers prepared inside handlers, such as event streams, and the 500 aiohttp
    answers to a handler's crash) adds the headers to every other answer."""

    def __init__(self, origins, methods, headers, credentials: bool):
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.methods = ALL_METHODS if "*" in methods else tuple(methods)
        self.any_header = "*" in headers
        self.headers = sorted(SAFELISTED_HEADERS | set(headers))
        self.allowed_headers = {header.lower() for header in self.headers}
        self.credentials = credentials
        # With credentials a browser refuses "*": the answer must name the page's origin, so it varies with it.
        self.echo_origin = not self.any_origin or credentials

    @classmethod
    def from_config(cls, config) -> "Cors":
        return cls(config.allowed_origins, config.allowed_methods, config.allowed_headers, config.allow_credentials)

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    @staticmethod
    def is_preflight(request: web.Request) -> bool:
        return (request.method == "OPTIONS" and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers)

    def middleware(self):
        @web.middleware
        async def answer_preflights(request: web.Request, handler):
            if self.is_preflight(request):
                return self.preflight(request)
            return await handler(request)

        return answer_preflights

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"]
        requested = request.headers.get("Access-Control-Request-Headers")
        headers = {"Access-Control-Allow-Methods": ", ".join(self.methods), "Access-Control-Max-Age": str(MAX_AGE_S)}
        refused = []
        if not self.allows(origin):
            refused.append("origin")
        if self.echo_origin:
            headers["Vary"] = "Origin"
            if not refused:
                headers["Access-Control-Allow-Origin"] = origin
        else:
            headers["Access-Control-Allow-Origin"] = "*"
        if method not in self.methods:
            refused.append("method")
        if self.any_header:
            if requested is not None:  # "*" is no wildcard on a credentialed request: name each header instead
                headers["Access-Control-Allow-Headers"] = requested
        else:
            headers["Access-Control-Allow-Headers"] = ", ".join(self.headers)
            names = (name.strip().lower() for name in (requested or "").split(","))
            if any(name and name not in self.allowed_headers for name in names):
                refused.append("headers")
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if refused:
            # Only the browser reads it (it hides the answer from the page), but the status tells a person why.
            logger.info("refused a CORS preflight from %s for %s %s: %s not allowed", origin[:100], method[:20],
                        request.path[:200], ", ".join(refused))
            response = error_response(400, "invalid_request", f"Disallowed CORS {', '.join(refused)}")
            response.headers.update(headers)
            return response
        return web.Response(text="OK", headers=headers)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        # A WebSocket's 101 is no CORS answer (browsers do not apply CORS to WebSockets); a preflight has its own.
        if origin is None or response.status == 101 or self.is_preflight(request):
            return
        if self.echo_origin:
            vary = response.headers.get("Vary")
            if vary is None:
                response.headers["Vary"] = "Origin"
            elif "origin" not in (name.strip().lower() for name in vary.split(",")):
                response.headers["Vary"] = f"{vary}, Origin"
            if not self.allows(origin):
                return
        response.headers["Access-Control-Allow-Origin"] = origin if self.echo_origin else "*"
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers["Access-Control-Expose-Headers"] = ", ".join(EXPOSED_HEADERS)
