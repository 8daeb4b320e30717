"""The browser demo (serving/static/connection.js) when its server is away, behind a proxy or over its limits: a
reverse proxy's 502/503/504 at load, a server that goes away while the page is idle and comes back, a 429 at the
WebSocket handshake (the per-key limits of serving/limits.py), and the close codes 1008 and 1011.

`ScriptedServer` serves the page's real routes (serving/demo.py) and stand-ins for /v1/models, /health and /v1/realtime
whose answers a test sets, on a fixed port it can leave and come back to; the 429s come from the real server. The
Chromium fixtures are test_demo_page.py's (a second browser when the two modules run on two xdist workers)."""
import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web
from demo_page_fixtures import API_KEY, idle, open_page, text_of, wait_for
from demo_page_fixtures import browser, engine, speech_wav  # noqa: F401 - pytest fixtures

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.demo import add_demo_routes
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import RealtimeClient, ServerThread

pytestmark = pytest.mark.slow

# connection.js asks /health every 5 s while idle, and an unreachable server again after 2 s: room for both, and
# for two cores shared with a browser.
NOTICE_S = 30
PROXY_PAGE = "<html><body><center><h1>{status} Bad Gateway</h1></center><hr><center>nginx</center></body></html>"


class ScriptedServer:
    """The demo page's routes and scripted stand-ins, on 127.0.0.1:`port` from a thread. `stop()` makes the server
    go away (the port refuses connections); `start()` brings it back on the same port."""

    def __init__(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.models_answers = []  # statuses /v1/models answers with a proxy's HTML page before its model list
        self.close = (1000, "")  # how /v1/realtime closes once the page's session.update came: (code, reason)
        self.asked = []  # the paths asked, in order
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="scripted-server", daemon=True)
        self._thread.start()
        self.runner = None
        self.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def url(self, path="/"):
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self):
        app = web.Application(middlewares=[self._record])
        add_demo_routes(app)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/realtime", self._realtime)
        self.runner = web.AppRunner(app)

        async def serve():
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        self.call(serve())

    def stop(self):
        self.call(self.runner.cleanup())

    def shutdown(self):
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    @web.middleware
    async def _record(self, request, handler):
        self.asked.append(request.path)
        return await handler(request)

    async def _health(self, request):
        return web.json_response({"status": "ok"})

    async def _models(self, request):
        if self.models_answers:
            status = self.models_answers.pop(0)
            return web.Response(status=status, text=PROXY_PAGE.format(status=status), content_type="text/html")
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def _realtime(self, request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"type": "session.created", "id": "scripted"})
        async for message in ws:
            if json.loads(message.data)["type"] == "session.update":
                code, reason = self.close
                await ws.close(code=code, message=reason.encode())
        return ws


@pytest.fixture
def scripted():
    server = ScriptedServer()
    yield server
    server.shutdown()


def status_class(driver) -> str:
    return driver.find_element("id", "status").get_attribute("class")


def test_a_proxys_502_503_504_at_load_are_retried_until_the_server_answers(browser, scripted):
    """nginx answers for a server that restarts behind it: the page said "The server answered 502 to /v1/models." for
    good. It now treats 502, 504 and a 503 that is not the server's own as a server that is down, says so, and is
    Ready without a reload once the server answers."""
    scripted.models_answers = [502, 503, 504]
    browser.get(scripted.url())
    wait_for(browser, lambda: "proxy in front of it answered 502" in text_of(browser, "status"), timeout=NOTICE_S)
    assert "Trying again in 2 s" in text_of(browser, "status") and "error" in status_class(browser)
    assert not browser.find_element("id", "start").is_enabled()
    wait_for(browser, lambda: "Ready" in text_of(browser, "status"), timeout=NOTICE_S)
    assert scripted.asked.count("/v1/models") == 4 and browser.find_element("id", "start").is_enabled()
    assert "scripted" in text_of(browser, "model")


def test_a_server_that_goes_away_while_the_page_is_idle_is_noticed_and_the_page_comes_back(browser, scripted):
    """The page was Ready and nobody pressed Start: it never noticed the server go, and said Ready for as long as the
    page stayed open. It now asks /health while idle, says the server is unavailable and that it retries, and is Ready
    again by itself once the server is back."""
    open_page(browser, scripted.url())
    wait_for(browser, lambda: "/health" in scripted.asked, timeout=NOTICE_S)  # watched, without the key's /v1/models
    assert scripted.asked.count("/v1/models") == 1
    scripted.stop()
    wait_for(browser, lambda: "cannot be reached" in text_of(browser, "status"), timeout=NOTICE_S)
    assert "Trying again in" in text_of(browser, "status") and "error" in status_class(browser)
    asked = len(scripted.asked)
    scripted.start()
    wait_for(browser, lambda: "Ready" in text_of(browser, "status"), timeout=NOTICE_S)
    # Back through /health, then the model list (the server may have restarted with another model or key).
    assert scripted.asked[asked:][-2:] == ["/health", "/v1/models"], scripted.asked[asked:]
    assert idle(browser)


@pytest.mark.parametrize("code, reason, words", [
    (1008, "client did not read for 30 s", "as a policy violation"),
    (1011, "", "after an internal error"),
])
def test_close_codes_1008_and_1011_have_plain_words(browser, scripted, code, reason, words):
    """The page showed "The connection closed before the transcript was complete (1008)." It now says what the code
    means, with the server's reason when it gives one: serving/websocket.py closes a connection whose client stopped
    reading with 1008 and no error event; 1011 with no error event first is a failure on the server's side."""
    scripted.close = (code, reason)
    open_page(browser, scripted.url())
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: idle(browser) and words in text_of(browser, "status"))
    status = text_of(browser, "status")
    assert f"({code})" not in status and (reason in status if reason else "said" not in status), status
    assert "error" in status_class(browser)


@pytest.mark.parametrize("limit", ["streams", "requests"])
def test_a_handshake_refused_for_the_keys_limits_says_so(browser, engine, limit):
    """A 429 before the upgrade (serving/limits.py, per API key: its open streams or its requests a minute) reaches a
    browser as a failed handshake, and the page said "The server refused the connection." It now says the server is
    at its limit for this key (for its requests: when to try again, from /v1/models' Retry-After)."""
    limits = Limits(max_streams_per_key=1) if limit == "streams" else Limits(max_requests_per_minute_per_key=1)
    server = ServerThread(engine, ServerConfig(api_keys=(API_KEY,), limits=limits))
    holder = None
    try:
        open_page(browser, server.url("/", scheme="http"), key=API_KEY)  # the key's one request, or its first stream
        if limit == "streams":  # another tab or program holds the key's one stream
            bearer = {"Authorization": f"Bearer {API_KEY}"}
            holder = server.call(RealtimeClient.connect(server.url(), additional_headers=bearer))
        browser.find_element("id", "start").click()
        wait_for(browser, lambda: idle(browser) and "Connecting" not in text_of(browser, "status"))
        status = text_of(browser, "status")
        expected = ("at its limit of open transcriptions for this API key" if limit == "streams"
                    else "as many requests from this API key as it takes in a minute. Try again in")
        assert expected in status and "refused" not in status, status
        assert "busy" in status_class(browser)
    finally:
        if holder is not None:
            server.call(holder.ws.close())
        server.close()
