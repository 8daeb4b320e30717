"""The browser demo's sessions in headless Chromium (fixtures: demo_page_fixtures.py): one session per Start
however the user clicks, Stop at every stage of a session, and a network that holds the page's audio back or
cannot keep up with the microphone."""
import time

import pytest
import soundfile
from demo_page_fixtures import (
    API_KEY, FINAL_WORDS, HEARD_AHEAD, all_sockets_closed, appends_sent, idle, listen_then_hold, open_page,
    reference_words_in, sockets_opened, spy_on_sockets, text_of, wait_for,
)
from demo_page_fixtures import browser, engine, server, speech_wav  # noqa: F401 - pytest fixtures

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import ServerThread

pytestmark = pytest.mark.slow


def test_a_double_click_on_start_runs_one_session(browser, server):
    from selenium.webdriver.common.action_chains import ActionChains

    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    spy_on_sockets(browser)
    ActionChains(browser).double_click(browser.find_element("id", "start")).perform()
    wait_for(browser, lambda: "Listening" in text_of(browser, "status"))
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))
    assert sockets_opened(browser) == 1
    wait_for(browser, lambda: all_sockets_closed(browser))  # Stop ended the only session


def test_start_while_a_file_loads_runs_one_session(browser, server, speech_wav):
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    spy_on_sockets(browser)
    browser.find_element("id", "file").send_keys(str(speech_wav))
    browser.execute_script("document.getElementById('start').click()")  # as a click that lands at once
    wait_for(browser, lambda: "Streaming speech.wav" in text_of(browser, "status"))
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))
    assert sockets_opened(browser) == 1
    wait_for(browser, lambda: all_sockets_closed(browser))


def test_stop_while_connecting_starts_no_session(browser, server):
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    spy_on_sockets(browser)
    browser.execute_script("window.__hold = true")  # session.created waits: a slow or distant server
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "Connecting" in text_of(browser, "status"))
    wait_for(browser, lambda: browser.find_element("id", "stop").is_enabled())
    browser.find_element("id", "stop").click()
    browser.execute_script("window.__release()")
    wait_for(browser, lambda: idle(browser))
    assert "Stopped" in text_of(browser, "status")
    wait_for(browser, lambda: all_sockets_closed(browser))
    assert "input_audio_buffer.append" not in browser.execute_script("return window.__sent")


# A microphone whose first 80 ms have not come yet: the capture worklet's messages never reach the page.
NO_CAPTURE_YET = """
window.AudioWorkletNode = class extends window.AudioWorkletNode {
  constructor(...args) {
    super(...args);
    Object.defineProperty(this.port, "onmessage", { get: () => null, set: () => {} });
  }
};
"""


def test_stop_before_any_audio_is_a_notice_not_an_error(browser, server):
    """Start, then Stop within the first 80 ms: nothing to transcribe, and nothing went wrong. The page said so in
    red, as an error; it is a plain notice now. No final commit goes, and the socket closes."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    spy_on_sockets(browser)
    browser.execute_script(NO_CAPTURE_YET)
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "Listening" in text_of(browser, "status"))
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))
    assert "No audio was captured" in text_of(browser, "status")
    assert browser.find_element("id", "status").get_attribute("class") == "status info"
    assert browser.execute_script("return window.__sent") == ["session.update", "input_audio_buffer.commit"]
    wait_for(browser, lambda: all_sockets_closed(browser))


def test_a_final_transcript_that_never_comes_is_given_up(browser, server):
    """A stalled network, or a server that never sends transcription.done: after Stop the page waits a few
    seconds (FINAL_WAIT_MS in app.js), then closes the socket (1000) and says the last words may be missing. It
    used to say "Finishing…" until the server's idle timeout closed the socket (150 s)."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    listen_then_hold(browser)
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: "Finishing the transcript" in text_of(browser, "status"))
    wait_for(browser, lambda: idle(browser), timeout=30)  # 5 s here; the old page waited out the server (150 s)
    status = text_of(browser, "status")
    assert "did not come within" in status and "last words may be missing" in status, status
    assert "warning" in browser.find_element("id", "status").get_attribute("class")
    assert browser.execute_script("return window.__pageCloses") == [1000]
    wait_for(browser, lambda: all_sockets_closed(browser))
    browser.execute_script("window.__release()")  # a done that comes after all changes nothing
    assert text_of(browser, "status") == status


def test_stop_again_while_finishing_ends_at_once(browser, server):
    """Stop while "Finishing…" (a second press) closes the socket at once: the user would rather end now."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    listen_then_hold(browser)
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: "Finishing the transcript" in text_of(browser, "status"))
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: idle(browser))
    # The second press's words, not the bounded wait's: the press ended it.
    assert "Stopped before the server finished" in text_of(browser, "status")
    assert browser.execute_script("return window.__pageCloses") == [1000]
    wait_for(browser, lambda: all_sockets_closed(browser))


def test_a_file_waits_while_the_network_holds_its_audio_back(browser, server, speech_wav):
    """The sending waits, and so does the playback: what the user hears is what the server has got."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    spy_on_sockets(browser)
    browser.execute_script(HEARD_AHEAD)
    browser.find_element("id", "file").send_keys(str(speech_wav))
    wait_for(browser, lambda: appends_sent(browser) >= 3)
    browser.execute_script("window.__backlog = 1e9")
    wait_for(browser, lambda: "Waiting for the network" in text_of(browser, "status"))
    time.sleep(1.5)  # a network wait a listener would notice: the playback used to run on through it
    browser.execute_script("window.__backlog = 0")
    wait_for(browser, lambda: "Done" in text_of(browser, "status"))
    assert browser.execute_script("return window.__appendsInBacklog") == 0
    # Each chunk leaves once it has been heard: within a fraction of a second of it, before and after the wait.
    ahead = browser.execute_script("return window.__heardAhead")
    assert max(abs(seconds) for seconds in ahead) < 0.5, ahead
    # Nothing was lost: every sample went, and the transcript is the file's.
    assert text_of(browser, "stat-audio") == f"{soundfile.info(speech_wav).duration:.1f} s"
    paragraph = browser.find_elements("css selector", "#transcript p.final")[-1]
    assert reference_words_in(paragraph.text) >= FINAL_WORDS, paragraph.text


def test_the_microphone_stops_when_the_network_cannot_keep_up(browser, server):
    """Live audio cannot wait: the page stops listening, says so, and finishes the transcript of what was sent
    instead of buffering without bound."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)
    spy_on_sockets(browser)
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: reference_words_in(text_of(browser, "transcript")) >= 3)
    browser.execute_script("window.__backlog = 1e9")
    wait_for(browser, lambda: "could not keep up" in text_of(browser, "status"))
    browser.execute_script("window.__backlog = 0")  # the commit goes; no audio follows it
    wait_for(browser, lambda: idle(browser))
    assert "could not keep up" in text_of(browser, "status")
    assert "warning" in browser.find_element("id", "status").get_attribute("class")
    assert browser.execute_script("return window.__appendsInBacklog") == 0
    sent = browser.execute_script("return window.__sent")
    assert sent[-1] == "input_audio_buffer.commit" and "input_audio_buffer.append" in sent
    assert browser.find_elements("css selector", "#transcript p.final")  # the audio sent was transcribed
    wait_for(browser, lambda: all_sockets_closed(browser))


def test_a_server_that_goes_away_mid_stream_is_explained(browser, engine):
    """The server dies mid-utterance (its connections reset, as a killed process's are: no close frame, 1006): the
    page keeps the text that came and says the connection was lost; Start then says the server cannot be
    reached (it said the server refused the connection)."""
    gone = ServerThread(engine, ServerConfig())
    try:
        open_page(browser, gone.url("/", scheme="http"))
        browser.find_element("id", "start").click()
        wait_for(browser, lambda: reference_words_in(text_of(browser, "transcript")) >= 2)

        async def reset_connections():
            for handler in gone.server.runner.server.connections:
                if handler.transport is not None:
                    handler.transport.abort()

        gone.call(reset_connections())
        wait_for(browser, lambda: idle(browser))
        assert "connection to the server was lost" in text_of(browser, "status")
        assert "error" in browser.find_element("id", "status").get_attribute("class")
        assert reference_words_in(text_of(browser, "transcript")) >= 2
    finally:
        gone.close()
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: "cannot be reached" in text_of(browser, "status"), timeout=30)
    wait_for(browser, lambda: idle(browser))


def test_start_on_a_server_gone_before_the_microphone_was_used_says_it_cannot_be_reached(browser, engine):
    """The server is gone before the first Start: the capture worklet's module, fetched from the server, fails to
    load, and the browser's words for it ("Failed to load worklet module script (Network error)") blamed the
    browser. The page asks /v1/models, which does not answer either, and says the server cannot be reached."""
    gone = ServerThread(engine, ServerConfig())
    try:
        open_page(browser, gone.url("/", scheme="http"))
    finally:
        gone.close()
    browser.find_element("id", "start").click()
    wait_for(browser, lambda: idle(browser))
    status = text_of(browser, "status")
    assert "cannot be reached" in status and "audio could not be set up" not in status, status
    assert "error" in browser.find_element("id", "status").get_attribute("class")


def test_a_page_loaded_while_the_server_is_down_connects_once_it_is_up(browser, server):
    """The page loads while its server cannot be reached (restarting, say): /v1/models fails as a refused
    connection does (Chromium blocks it: DevTools' Network.setBlockedURLs). The page says it tries again, and
    becomes Ready without a reload once the server answers; it said "cannot be reached" for good."""
    open_page(browser, server.url("/", scheme="http"), key=API_KEY)  # the key, in the tab's sessionStorage
    browser.execute_cdp_cmd("Network.enable", {})
    try:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/v1/models"]})
        browser.get(server.url("/", scheme="http"))
        wait_for(browser, lambda: "Trying again" in text_of(browser, "status"), timeout=10)
        assert "cannot be reached" in text_of(browser, "status")
        assert not browser.find_element("id", "start").is_enabled()
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})  # the server is up
        wait_for(browser, browser.find_element("id", "start").is_enabled, timeout=10)  # the first retry: 2 s
        assert "Ready" in text_of(browser, "status")
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
        browser.execute_cdp_cmd("Network.disable", {})
