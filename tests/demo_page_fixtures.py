"""What the browser demo's tests share (test_demo_page.py, test_demo_page_sessions.py,
test_demo_page_reconnect.py): a real server over loopback, headless Chromium with a fake microphone playing the
bundled speech sample, and helpers that read the page and spy on its WebSocket.

The browser tests need Debian's `chromium` and `chromium-driver` (`.ci/run` installs them) and are skipped
without them."""
import contextlib
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
import soundfile

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import ServerThread, sample_audio, sample_words, shared_engine

API_KEY = "demo-key"
REFERENCE = set(sample_words())  # the words the pages' speech says
# The embedded model gets the sample exactly (README); a live transcript shows nearly all of its words, a final
# one through the browser's audio path (resampled, or sent twice) all but a few.
LIVE_WORDS, FINAL_WORDS = len(REFERENCE) - 2, len(REFERENCE) - 3
WAIT_S = 90  # generous: two cores are shared with the engine thread and the browser


@pytest.fixture(scope="module")
def engine():
    return shared_engine()


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine, ServerConfig(api_keys=(API_KEY,)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory):
    """The sample as a 16-bit wav for Chromium's fake microphone, which loops it: a second of silence
    first, and two after, so one pass is a clean utterance."""
    pcm = sample_audio()
    silence = np.zeros(16000, np.float32)
    path = tmp_path_factory.mktemp("audio") / "speech.wav"
    soundfile.write(path, np.concatenate([silence, pcm, silence, silence]), 16000, subtype="PCM_16")
    return path


def http_get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()



# -- the page in Chromium -----------------------------------------------------------------------------
@contextlib.contextmanager
def chromium(profile, microphone: str, *, autoplay: bool = True):
    """Headless Chromium with a fake microphone: `microphone` is a wav to play (looped), or "deny". `autoplay`:
    audio may play before the page has had a click (else browsers' default rule: only after one)."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--window-size=1000,860", "--use-fake-device-for-media-stream",
             f"--user-data-dir={profile}"]
    if autoplay:
        flags.append("--autoplay-policy=no-user-gesture-required")
    if microphone == "deny":
        flags.append("--use-fake-ui-for-media-stream=deny")  # as if the user refused the prompt
    else:
        flags += ["--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={microphone}"]
    for flag in flags:
        options.add_argument(flag)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager look for a driver online
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def browser(speech_wav, tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile"), str(speech_wav)) as driver:
        yield driver


def wait_for(driver, condition, timeout=WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition())
    except Exception:
        status = driver.find_element("id", "status").text
        transcript = driver.find_element("id", "transcript").text
        logs = "\n".join(str(entry) for entry in driver.get_log("browser"))
        raise AssertionError(f"timed out; status {status!r}, transcript {transcript!r}\n{logs}") from None


def text_of(driver, element_id):
    return driver.find_element("id", element_id).text


def reference_words_in(text: str) -> int:
    return len(REFERENCE & set(text.lower().split()))


def open_page(driver, url, *, key=None):
    """Loads the page and waits until it is ready; enters `key` when the page asks for one."""
    driver.get(url)
    start, panel = driver.find_element("id", "start"), driver.find_element("id", "key-panel")
    wait_for(driver, lambda: start.is_enabled() or panel.is_displayed())
    if panel.is_displayed():
        assert key is not None, text_of(driver, "status")
        assert "needs an API key" in text_of(driver, "status")
        driver.find_element("id", "api-key").send_keys(key)
        driver.find_element("css selector", "#key-panel button").click()
    wait_for(driver, start.is_enabled)


def save_screenshot(driver, tmp_path, name):
    path = tmp_path / name
    driver.save_screenshot(str(path))
    artifacts = os.environ.get("JAXSTREAM_TEST_ARTIFACTS")
    if artifacts:
        os.makedirs(artifacts, exist_ok=True)
        shutil.copy(path, os.path.join(artifacts, name))
    return path


# The page's WebSocket, wrapped: every socket opened (window.__sockets), every event type sent (window.__sent)
# and the code of every close() the page called (window.__pageCloses); while window.__hold is true, the
# server's messages wait for window.__release().
# window.__backlog: bytes a slow network holds back, added to the socket's bufferedAmount (on loopback the
# kernel takes some 3 MB, over a minute of audio, before a browser's bufferedAmount grows); the appends sent
# while it is set are counted in window.__appendsInBacklog.
SOCKET_SPY = """
window.__sockets = []; window.__sent = []; window.__hold = false; window.__held = [];
window.__backlog = 0; window.__appendsInBacklog = 0; window.__pageCloses = [];
window.__release = () => { window.__hold = false; window.__held.splice(0).forEach((deliver) => deliver()); };
window.WebSocket = class extends window.WebSocket {
  constructor(...args) { super(...args); window.__sockets.push(this); }
  close(...args) { window.__pageCloses.push(args[0]); super.close(...args); }
  get bufferedAmount() { return super.bufferedAmount + window.__backlog; }
  send(data) {
    const type = JSON.parse(data).type;
    window.__sent.push(type);
    if (window.__backlog && type === "input_audio_buffer.append") window.__appendsInBacklog++;
    super.send(data);
  }
  set onmessage(handler) {
    super.onmessage = (m) => (window.__hold ? window.__held.push(() => handler(m)) : handler(m));
  }
};
"""


def spy_on_sockets(driver):
    driver.execute_script(SOCKET_SPY)


def sockets_opened(driver) -> int:
    return driver.execute_script("return window.__sockets.length")


def all_sockets_closed(driver) -> bool:
    return driver.execute_script("return window.__sockets.every((ws) => ws.readyState === WebSocket.CLOSED)")


def appends_sent(driver) -> int:
    return driver.execute_script("return window.__sent.filter((type) => type === 'input_audio_buffer.append').length")


def idle(driver) -> bool:
    """No session runs: Start is enabled again and Stop is not."""
    return driver.find_element("id", "start").is_enabled() and not driver.find_element("id", "stop").is_enabled()


def listen_then_hold(driver):
    """Start listening; once audio went, hold the server's messages: its transcription.done never comes."""
    spy_on_sockets(driver)
    driver.find_element("id", "start").click()
    wait_for(driver, lambda: appends_sent(driver) >= 2)
    driver.execute_script("window.__hold = true")


# Per append, the seconds of the file the listener has heard (the playback's audio clock since the page started
# the player, plus the offset into the file it started at) less the seconds sent (window.__heardAhead); nothing
# before the player starts.
HEARD_AHEAD = """
window.__heardAhead = [];
let player = null, sent = 0;
const start = AudioBufferSourceNode.prototype.start;
AudioBufferSourceNode.prototype.start = function (...args) {
  // The player, not the OfflineAudioContext's source that resamples the file.
  if (this.context instanceof AudioContext) player = [this.context, this.context.currentTime - (args[1] || 0)];
  return start.apply(this, args);
};
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  const event = JSON.parse(data);
  if (event.type === "input_audio_buffer.append") {
    sent += atob(event.audio).length / 2 / 16000;
    if (player) window.__heardAhead.push(player[0].currentTime - player[1] - sent);
  }
  return send.call(this, data);
};
"""
