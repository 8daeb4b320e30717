"""The browser demo at `GET /` (serving/demo.py, serving/static/): its routes over HTTP, then the page in
headless Chromium with a fake microphone playing the bundled speech sample, against a real server over
loopback. A screenshot of the page with its transcript is saved as a test artifact (tmp_path, and
$JAXSTREAM_TEST_ARTIFACTS when set).

The browser tests need Debian's `chromium` and `chromium-driver` (`.ci/run` installs them) and are skipped
without them. Shared fixtures and helpers: demo_page_fixtures.py; sessions and networks:
test_demo_page_sessions.py; connection loss and retries: test_demo_page_reconnect.py."""
import base64
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile
from demo_page_fixtures import (
    API_KEY, FINAL_WORDS, HEARD_AHEAD, LIVE_WORDS, appends_sent, chromium, http_get, idle, open_page,
    reference_words_in, save_screenshot, spy_on_sockets, text_of, wait_for,
)
from demo_page_fixtures import browser, engine, server, speech_wav  # noqa: F401 - pytest fixtures

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.demo import PUBLIC_PATHS
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import RealtimeClient, ServerThread

pytestmark = pytest.mark.slow


# -- routes -------------------------------------------------------------------------------------------
def test_page_and_assets_are_served_without_the_key(server):
    status, headers, page = http_get(server.url("/", scheme="http"))
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "__DELAYS__" not in page and 'data-delays="80,160,240,' in page and ",2400\"" in page
    assert "connect-src 'self'" in headers["Content-Security-Policy"]
    for path in PUBLIC_PATHS - {"/"}:
        status, headers, body = http_get(server.url(path, scheme="http"))
        assert status == 200 and body, path
        kind = "text/css" if path.endswith(".css") else "javascript"
        assert kind in headers["Content-Type"], (path, headers["Content-Type"])
    # Everything else still needs the key.
    assert http_get(server.url("/v1/models", scheme="http"))[0] == 401
    assert http_get(server.url("/static/../demo.py", scheme="http"))[0] in (401, 404)


def test_package_data_ships_the_page():
    from importlib.resources import files

    static = files("jaxstream.serving").joinpath("static")
    assert {"index.html", *(path.rsplit("/", 1)[1] for path in PUBLIC_PATHS - {"/"})} <= {
        entry.name for entry in static.iterdir()}


def test_microphone_transcript_appears_live_behind_the_api_key(browser, server, tmp_path):
    browser.get(server.url("/", scheme="http"))
    browser.execute_script("sessionStorage.clear()")  # the page must ask for the key
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    assert not browser.find_element("id", "key-panel").is_displayed()
    assert server.state.model_id in text_of(browser, "model")
    browser.find_element("css selector", "#delay option[value='480']").click()
    browser.find_element("id", "start").click()
    # Partial text shows while the microphone still runs, then Stop gives the final transcript.
    wait_for(browser, lambda: browser.find_element("id", "level").size["width"] > 0)  # the meter moves
    wait_for(browser, lambda: reference_words_in(text_of(browser, "transcript")) >= LIVE_WORDS)
    assert browser.find_elements("css selector", "#transcript p.partial")
    assert "Listening" in text_of(browser, "status")
    save_screenshot(browser, tmp_path, "demo_page_live.png")
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: browser.find_elements("css selector", "#transcript p.final"))
    final = text_of(browser, "transcript")
    assert reference_words_in(final) >= FINAL_WORDS, final
    assert text_of(browser, "stat-delay") == "480 ms"
    assert text_of(browser, "stat-first").endswith(" ms") and text_of(browser, "stat-final").endswith(" ms")
    save_screenshot(browser, tmp_path, "demo_page.png")


@pytest.fixture
def checked_requests(monkeypatch) -> list:
    """(path and query, offered subprotocols) of every request the server's API-key check reads a key from."""
    from jaxstream.serving import auth

    seen, presented_key = [], auth.presented_key

    def recording(request):
        seen.append((request.path_qs, tuple(auth.offered_subprotocols(request))))
        return presented_key(request)

    monkeypatch.setattr(auth, "presented_key", recording)
    return seen


def listen_once(browser) -> tuple[str, str]:
    """Start, then Stop once listening (session.created: the key was taken): (the socket's URL, the subprotocol
    the server selected)."""
    spy_on_sockets(browser)
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "Listening" in text_of(browser, "status"))
    url, selected = browser.execute_script("const ws = window.__sockets[0]; return [ws.url, ws.protocol];")
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))
    return url, selected


def test_the_api_key_travels_in_the_handshake_not_in_the_url(browser, server, checked_requests):
    """Access logs and proxies keep URLs: the page offers the key as the subprotocol `openai-insecure-api-key.<key>`
    (OpenAI's browser clients' way; serving/auth.py) next to `vllm-realtime`, which the server selects (a browser
    fails a handshake that offered subprotocols and selected none) without echoing the key."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    url, selected = listen_once(browser)
    assert url == server.url("/v1/realtime")
    assert selected == "vllm-realtime"  # vLLM's protocol: `realtime` would have made it OpenAI's dialect
    # (The key is read more than once per request: the auth check, then the per-key limits.)
    handshakes = {request for request in checked_requests if request[0].startswith("/v1/realtime")}
    assert handshakes == {("/v1/realtime", ("vllm-realtime", f"openai-insecure-api-key.{API_KEY}"))}
    assert not any(API_KEY in path for path, _ in checked_requests)  # /v1/models has it as a Bearer header


def test_a_refused_key_brings_back_the_key_panel(browser, server):
    browser.get(server.url("/", scheme="http"))
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url("/", scheme="http"))
    panel = browser.find_element("id", "key-panel")
    wait_for(browser, panel.is_displayed)
    browser.find_element("id", "api-key").send_keys("wrong-key")
    browser.find_element("css selector", "#key-panel button").click()
    wait_for(browser, lambda: "refused this API key" in text_of(browser, "key-message"))
    browser.find_element("id", "api-key").clear()
    browser.find_element("id", "api-key").send_keys(API_KEY)
    browser.find_element("css selector", "#key-panel button").click()
    wait_for(browser, browser.find_element("id", "start").is_enabled)
    # The key stops working under a loaded page (the server restarted with another): a browser does not say
    # why a handshake failed, so the page asks /v1/models, and asks for a key again.
    browser.execute_script("apiKey = 'wrong-key'")
    browser.find_element("id", "start").click()
    wait_for(browser, panel.is_displayed)
    assert "refused this API key" in text_of(browser, "key-message")
    assert not browser.find_element("id", "start").is_enabled()


# What `openssl rand -base64 32` prints: a subprotocol is an HTTP token (RFC 9110 5.6.2), which `/` and `=` are not.
BASE64_KEY = "hGLOaKzxRzYt7DD6eI6jUh1YELRGcA+MBk+tWXKcMXA="


def test_a_key_no_handshake_can_carry_travels_in_the_query(browser, engine, checked_requests):
    """A base64 key cannot be a subprotocol (the browser refuses to offer it). The page refused such keys, which
    worked before (in `?api_key=`, which the server still accepts: serving/auth.py): it now sends them there, and
    a token key still in the handshake (test_the_api_key_travels_in_the_handshake_not_in_the_url)."""
    keyed = ServerThread(engine, ServerConfig(api_keys=(BASE64_KEY,)))
    try:
        browser.get(keyed.url("/", scheme="http"))
        browser.execute_script("sessionStorage.clear()")
        open_page(browser, keyed.url("/", scheme="http"), key=BASE64_KEY)
        url, selected = listen_once(browser)
    finally:
        keyed.close()
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(url).query) == {"api_key": [BASE64_KEY]}
    assert selected == ""  # no subprotocol offered: the server's default dialect, vLLM's, as with one
    handshakes = {request for request in checked_requests if request[0].startswith("/v1/realtime")}
    assert [urllib.parse.parse_qs(urllib.parse.urlsplit(path).query) for path, _ in handshakes] == [
        {"api_key": [BASE64_KEY]}] and all(offered == () for _, offered in handshakes), handshakes


def test_a_dropped_file_streams_at_real_time(browser, server, speech_wav):
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    browser.find_element("id", "file").send_keys(str(speech_wav))
    wait_for(browser, lambda: "Streaming speech.wav" in text_of(browser, "status"))
    started = browser.execute_script("return performance.now()")
    wait_for(browser, lambda: "Done" in text_of(browser, "status"))
    elapsed = (browser.execute_script("return performance.now()") - started) / 1000
    seconds = soundfile.info(speech_wav).duration
    assert elapsed > seconds - 1.0  # paced at real time, not sent at once
    paragraphs = browser.find_elements("css selector", "#transcript p.final")
    assert paragraphs[-1].get_attribute("data-source") == "speech.wav"
    assert reference_words_in(paragraphs[-1].text) >= FINAL_WORDS, paragraphs[-1].text
    assert text_of(browser, "stat-audio") == f"{seconds:.1f} s"


def test_a_first_visit_streams_a_file_before_any_click_and_explains_a_denied_microphone(server, speech_wav,
                                                                                           tmp_path):
    """A first visit, as browsers treat one: no audio plays before a click on the page, and the microphone is
    refused. A file given before any click (a drop is no click; nor is the driver setting the file input) streams
    all the same: the page used to wait for ever for its playback to be allowed. The page says that its playback is
    silent until a click (it said nothing), and a click then starts the playback where the file has got to (it
    started at the file's beginning, behind what was sent). Then Start, refused, explains."""
    with chromium(tmp_path / "profile", "deny", autoplay=False) as browser:
        browser.get(server.url("/", scheme="http"))
        browser.execute_script("sessionStorage.setItem('jaxstream-api-key', arguments[0])", API_KEY)  # no click
        open_page(browser, server.url("/", scheme="http"))
        assert not browser.execute_script("return navigator.userActivation.hasBeenActive")
        spy_on_sockets(browser)
        browser.execute_script(HEARD_AHEAD)
        browser.find_element("id", "file").send_keys(str(speech_wav))
        wait_for(browser, lambda: "silent until the page has been clicked" in text_of(browser, "status"), timeout=30)
        assert "Streaming speech.wav" in text_of(browser, "status")
        wait_for(browser, lambda: appends_sent(browser) >= 15, timeout=30)  # 1.2 s of the file went unheard
        browser.find_element("id", "transcript").click()  # a click on the page, on no control
        wait_for(browser, lambda: "silent" not in text_of(browser, "status"), timeout=10)
        assert "Streaming speech.wav" in text_of(browser, "status")
        heard = len(browser.execute_script("return window.__heardAhead"))
        wait_for(browser, lambda: len(browser.execute_script("return window.__heardAhead")) >= heard + 3, timeout=10)
        # Each chunk sent after the click was heard within a fraction of a second of its sending.
        ahead = browser.execute_script("return window.__heardAhead")
        assert max(abs(seconds) for seconds in ahead) < 0.5, ahead
        browser.find_element("id", "stop").click()
        wait_for(browser, lambda: idle(browser))
        assert "Done" in text_of(browser, "status")

        browser.find_element("id", "start").click()
        wait_for(browser, lambda: "denied" in text_of(browser, "status"), timeout=30)
        assert "Allow the microphone" in text_of(browser, "status")
        assert "error" in browser.find_element("id", "status").get_attribute("class")
        assert browser.find_element("id", "start").is_enabled()  # ready to try again


def test_a_busy_server_is_explained(browser, engine):
    busy = ServerThread(engine, ServerConfig(limits=Limits(max_connections=1)))
    try:
        holder = busy.call(RealtimeClient.connect(busy.url()))  # takes the only connection
        try:
            open_page(browser, busy.url("/", scheme="http"))
            browser.find_element("id", "start").click()
            wait_for(browser, lambda: "busy" in text_of(browser, "status"))
            assert "busy" in browser.find_element("id", "status").get_attribute("class")
            assert browser.find_element("id", "start").is_enabled()
        finally:
            busy.call(holder.close())
    finally:
        busy.close()


def realtime_error_codes() -> set[str]:
    """Every error code a /v1/realtime connection in vLLM's protocol can carry, found in the server's source as
    tests/test_serve_error_types.py finds every route's: the protocol's errors (`ProtocolError(code, ...)` and
    `self._error(code, ...)` in serving/vllm_realtime.py), the ends of a connection (`Breach(outcome, close_code,
    error_code, ...)` in the modules every WebSocket runs through: app.py's refusals and drain, websocket.py,
    limits.py) and the engine's errors (each EngineError class's `code`), which the protocol passes on."""
    import ast

    import jaxstream.serving
    from jaxstream.errors import EngineError

    def strings(node) -> set[str]:  # a literal, or either branch of `a if c else b`
        if isinstance(node, ast.IfExp):
            return strings(node.body) | strings(node.orelse)
        return {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()

    source = Path(jaxstream.serving.__file__).parent
    code_argument = {"vllm_realtime.py": {"ProtocolError": 0, "_error": 0, "Breach": 2},
                     "app.py": {"Breach": 2}, "websocket.py": {"Breach": 2}, "limits.py": {"Breach": 2}}
    codes = set()
    for module, positions in code_argument.items():
        for node in ast.walk(ast.parse((source / module).read_text())):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if name in positions and len(node.args) > positions[name]:
                    codes |= strings(node.args[positions[name]])
    classes = [EngineError]
    while classes:
        error = classes.pop()
        codes.add(error.code)
        classes += error.__subclasses__()
    return codes


def test_every_error_code_of_the_realtime_route_has_plain_words(browser, server):
    """The page showed a code it had no words for raw: "Server error server_shutdown: The server shut down before
    the transcription finished". Every code the server can send on /v1/realtime now has words (ERROR_TEXT)."""
    codes = realtime_error_codes()
    assert {"server_shutdown", "capacity", "idle_timeout", "generation_in_progress", "backlog"} <= codes, codes
    browser.get(server.url("/", scheme="http"))
    words = browser.execute_script("return ERROR_TEXT")
    assert sorted(codes - words.keys()) == []
    for code in codes:
        assert words[code].endswith((".", ")")) and "_" not in words[code], (code, words[code])


def test_a_server_shutdown_mid_utterance_is_explained(browser, engine):
    """A graceful shutdown (SIGTERM: app.drain) whose deadline cuts an utterance off: the server sends the error
    `server_shutdown`, then closes with 1001. The page showed the raw code; it now says it in words."""
    from jaxstream.serving.app import drain

    stopping = ServerThread(engine, ServerConfig())
    try:
        open_page(browser, stopping.url("/", scheme="http"))
        browser.find_element("id", "start").click()
        wait_for(browser, lambda: any(conn.protocol.busy() for conn in list(stopping.state.connections)))
        assert not stopping.call(drain(stopping.app, timeout=0))  # False: an utterance was cut off
        wait_for(browser, lambda: idle(browser))
        status = text_of(browser, "status")
        assert status == browser.execute_script("return ERROR_TEXT.server_shutdown"), status
        assert "shut down" in status and "server_shutdown" not in status
        assert "error" in browser.find_element("id", "status").get_attribute("class")
    finally:
        stopping.close()


def test_without_audio_worklet_files_stream_and_start_explains(browser, server, speech_wav):
    """As on a page that is neither https nor localhost, where browsers give no AudioWorklet."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    browser.execute_script("delete BaseAudioContext.prototype.audioWorklet")
    browser.find_element("id", "file").send_keys(str(speech_wav))
    wait_for(browser, lambda: "Streaming speech.wav" in text_of(browser, "status"))
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "audio could not be set up" in text_of(browser, "status"))
    assert "error" in browser.find_element("id", "status").get_attribute("class")
    wait_for(browser, lambda: idle(browser))


def test_a_failed_worklet_load_is_tried_again(browser, server):
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    browser.execute_script("window.__addModule = AudioWorklet.prototype.addModule;"
                           "AudioWorklet.prototype.addModule = () => Promise.reject(new Error('load failed'));")
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "load failed" in text_of(browser, "status"))
    wait_for(browser, lambda: idle(browser))
    browser.execute_script("AudioWorklet.prototype.addModule = window.__addModule")
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "Listening" in text_of(browser, "status"))
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))


# The capture worklet (pcm16-worklet.js) in an OfflineAudioContext at `rate`: a tone of `frequency` Hz at
# amplitude 0.5 for `seconds`; returns the 16 kHz PCM16 it posted, once `wanted` samples came or 10 s passed
# (its messages may still be on their way when rendering ends).
WORKLET_TONE = """
const [rate, frequency, seconds, wanted, done] = arguments;
(async () => {
  const context = new OfflineAudioContext(1, Math.round(rate * seconds), rate);
  await context.audioWorklet.addModule("/static/pcm16-worklet.js");
  const capture = new AudioWorkletNode(context, "pcm16-capture", {channelCount: 1, channelCountMode: "explicit"});
  const pcm = [];
  capture.port.onmessage = (message) => pcm.push(...new Int16Array(message.data.pcm));
  const tone = new OscillatorNode(context, {frequency});
  tone.connect(new GainNode(context, {gain: 0.5})).connect(capture).connect(context.destination);
  tone.start();
  await context.startRendering();
  for (let waited = 0; pcm.length < wanted && waited < 10000; waited += 20) {
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  done(pcm);
})().catch((err) => done(String(err)));
"""


def tone_amplitude(pcm: np.ndarray, frequency: float, rate: int = 16000) -> float:
    """The amplitude of the `frequency` component of `pcm` by a one-bin DFT in float64; exact (no leakage)
    when `pcm` holds whole periods of every tone in it, as one second does of whole-hertz tones."""
    phase = np.exp(-2j * np.pi * frequency * np.arange(pcm.size) / rate)
    return 2 * abs(np.dot(pcm.astype(np.float64), phase)) / pcm.size


@pytest.mark.parametrize("rate, frequency, heard_at, level_db", [
    (48000, 1000, 1000, 0.0),  # speech band: passes unchanged
    (44100, 1000, 1000, 0.0),
    (16000, 1000, 1000, 0.0),  # the browser resampled already
    (8000, 1000, 1000, 0.0),  # upsampled: still 1 kHz, not 2 kHz (an 8 kHz context read as 16 kHz)
    (48000, 10000, 6000, None),  # above 8 kHz: would fold onto 16 - 10 = 6 kHz; must be filtered out
    (44100, 10000, 6000, None),
    (44100, 9000, 7000, None),
    (8000, 1000, 7000, None),  # upsampling's image of 1 kHz at 8 - 1 = 7 kHz
])
def test_the_worklet_resamples_to_16_khz(browser, server, rate, frequency, heard_at, level_db):
    """The capture worklet's output, measured by a DFT: a tone in the band comes out at its frequency and
    amplitude (within 0.1 dB), and what lies above 8 kHz, or is an image of the input, 60 dB down at least."""
    browser.get(server.url("/", scheme="http"))  # the page's origin: its CSP lets the worklet load
    browser.set_script_timeout(60)
    seconds, chunk = 1.5, 1280
    wanted = int(seconds * 16000) // chunk * chunk  # every whole 80 ms chunk of 16 kHz audio in 1.5 s
    pcm = browser.execute_async_script(WORKLET_TONE, rate, frequency, seconds, wanted)
    assert isinstance(pcm, list), pcm
    assert len(pcm) == wanted, f"{seconds} s at {rate} Hz came out as {len(pcm) / 16000} s at 16 kHz"
    second = np.asarray(pcm[chunk:chunk + 16000]) / 32767  # one second, after the filter's first samples
    amplitude_db = 20 * np.log10(max(tone_amplitude(second, heard_at), 1e-9) / 0.5)
    if level_db is not None:
        assert abs(amplitude_db - level_db) < 0.1, amplitude_db
    else:
        assert amplitude_db < -60, amplitude_db


def test_no_session_is_left_behind(server, engine):
    from jaxstream.serving.testing import wait_engine_baseline

    server.call(wait_engine_baseline(engine, timeout=10))
    assert not server.state.connections


def notebook_microphone_js() -> str:
    """MIC_JS, the browser half of the Colab notebook's live microphone (colab/jaxstream_realtime.ipynb)."""
    import ast
    import json

    notebook = json.loads((Path(__file__).resolve().parents[1] / "colab" / "jaxstream_realtime.ipynb").read_text())
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "MIC_JS = " in source:
            tree = compile(source, "<cell>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            for node in tree.body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MIC_JS":
                    return ast.literal_eval(node.value)
    raise AssertionError("no MIC_JS in the notebook")


def test_the_notebooks_microphone_capture_in_chromium(browser, server, engine):
    """What Colab's eval_js would run: start() with the page's worklet, take() until 10.5 s of PCM16 arrived;
    that audio transcribes to the sample's words. Run on a page of the server without the demo's CSP (Colab's
    output frame has none; the notebook loads the worklet from a Blob URL)."""
    browser.get(server.url("/no-such-page", scheme="http"))  # same secure origin, no page script
    worklet = (Path(__file__).resolve().parents[1] / "serving" / "static" / "pcm16-worklet.js").read_text()
    browser.execute_script(notebook_microphone_js())
    browser.set_script_timeout(30)
    started = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "jaxstreamMic.start(arguments[0]).then(() => done('ok'), (err) => done(String(err)));", worklet)
    assert started == "ok"
    pieces = []
    # The fake microphone may start anywhere in the looped 6.5 s wav: 10.5 s hold one whole utterance.
    while sum(piece.size for piece in pieces) < 10.5 * 16000:
        reply = browser.execute_async_script(
            "const done = arguments[arguments.length - 1]; jaxstreamMic.take().then(done);")
        assert not reply["stopped"]
        pieces.append(np.frombuffer(base64.b64decode(reply["audio"]), "<i2").astype(np.float32) / 32768.0)
    browser.execute_script("jaxstreamMic.stop()")
    pcm = np.concatenate(pieces)
    assert np.abs(pcm).max() > 0.1  # speech, not silence
    done = server.call(engine.transcribe(pcm))
    assert reference_words_in(done.text) >= FINAL_WORDS, done.text
