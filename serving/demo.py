"""The browser demo of `jaxstream serve`: `GET /` and its assets under `/static/` (serving/static/).

A plain HTML + JavaScript page, no build step: it captures the microphone with an AudioWorklet, which
resamples from whatever rate the browser's audio runs at with a windowed-sinc low-pass (or streams a dropped
file at real time), sends 16 kHz PCM16 over `/v1/realtime` and shows the transcript as it
streams, with a delay selector, a level meter and latency figures. When the server has an API key the page
asks for it and sends it as a Bearer header to `/v1/models`, and to `/v1/realtime` as the WebSocket subprotocol
`openai-insecure-api-key.<key>` next to `vllm-realtime` (browsers cannot set other WebSocket headers; a URL's
`?api_key=` would land in access logs and proxies). The audio leaves at real time; what the network cannot take
waits in the socket (`bufferedAmount`) up to about 2 s: a file then waits, its playback paused with it (the listener
hears what the server has got), and the microphone stops and says why. After Stop the page waits at most 5 s for the
final transcript (a second Stop ends at once), then keeps the text that came and says its last words may be missing.
The page's sentences, one for every error code the server sends on `/v1/realtime`, are in `static/messages.js`.
`static/connection.js` keeps the page in touch with the server: `/v1/models` at load, `/health` every 5 s while the page
is idle, and retries with backoff (2 s, up to 30 s) while the server cannot be reached or its reverse proxy answers
502/503/504, until the page is Ready again by itself.

The page and its assets hold no secret, so they are served without a key: `PUBLIC_PATHS` lists them for the
auth middleware. The delays the selector offers come from `jaxstream.models.audio`, their one owner.
"""
from pathlib import Path

from aiohttp import web

from jaxstream.models.audio import ALLOWED_DELAYS_MS

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = ("app.js", "connection.js", "messages.js", "pcm16-worklet.js", "style.css")
PUBLIC_PATHS = frozenset({"/"} | {f"/static/{name}" for name in ASSETS})

# The page only talks to its own origin; a strict policy keeps an injected script from sending the API key
# anywhere else. `no-cache`: browsers revalidate, so a server upgrade never runs a stale app.js.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'self'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_demo_routes(app: web.Application) -> None:
    """Registers `GET /` (the page) and `GET /static/<asset>` on `app`."""
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8").replace(
        "__DELAYS__", ",".join(str(ms) for ms in ALLOWED_DELAYS_MS))

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", headers=_HEADERS)

    app.router.add_get("/", index)
    for name in ASSETS:
        app.router.add_get(f"/static/{name}", _asset(STATIC_DIR / name))


def _asset(path: Path):
    async def serve(request: web.Request) -> web.FileResponse:
        # FileResponse sets the type from the suffix (an AudioWorklet module must be served as JavaScript)
        # and answers conditional requests with 304.
        return web.FileResponse(path, headers=_HEADERS)

    return serve
