"""examples/realtime_client.py and examples/microphone_client.py as a user runs them: subprocesses against a
server over loopback. Every failure ends the run with one line on stderr (no traceback) and exit code 1,
instead of a wait for a transcription.done that never comes. The microphone is a fake `sounddevice` module
that plays a wav at real time, or delivers nothing.

The test server closes idle connections after a few seconds, so a client that waits forever fails here at
once (with the traceback of the close) rather than after the default 150 s."""
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread, sample_audio, sample_words
from serve_fixtures import engine, engine_returns_to_baseline  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
API_KEY = "clients-key"
EXIT_S = 60  # a client still running after this is waiting for something that never comes

FAKE_SOUNDDEVICE = '''
"""sounddevice for the tests: plays $FAKE_MICROPHONE (a 16 kHz wav) once at real time, then prints
"microphone: played" on stderr and delivers nothing more; without it, a device that never delivers."""
import os
import sys
import threading
import time

import soundfile


class PortAudioError(Exception):
    pass


class InputStream:
    def __init__(self, samplerate, channels, dtype, blocksize, callback):
        self.blocksize, self.callback = blocksize, callback
        path = os.environ.get("FAKE_MICROPHONE")
        self.audio = soundfile.read(path, dtype="float32", always_2d=True)[0] if path else None
        self.closed = threading.Event()

    def play(self):
        start = time.monotonic()
        for begin in range(0, len(self.audio) - self.blocksize + 1, self.blocksize):
            if self.closed.wait(max(0.0, start + (begin + self.blocksize) / 16000 - time.monotonic())):
                return
            self.callback(self.audio[begin:begin + self.blocksize], self.blocksize, None, None)
        print("microphone: played", file=sys.stderr, flush=True)

    def __enter__(self):
        if self.audio is not None:
            self.thread = threading.Thread(target=self.play, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.closed.set()
'''


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811 - the fixture imported above
    server = ServerThread(engine, ServerConfig(api_keys=(API_KEY,), limits=Limits(idle_timeout_s=3.0)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wavs")
    soundfile.write(folder / "speech.wav", sample_audio(), 16000, subtype="PCM_16")
    soundfile.write(folder / "empty.wav", np.zeros(0, np.float32), 16000, subtype="PCM_16")
    return folder


@pytest.fixture(scope="module")
def fake_sounddevice(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fake-sounddevice")
    (folder / "sounddevice.py").write_text(FAKE_SOUNDDEVICE)
    return folder


class Client:
    """One example client as a subprocess; its stderr is read line by line as it comes."""

    def __init__(self, script: str, *args: str, env: dict | None = None):
        self.process = subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.stderr: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self._readers = [threading.Thread(target=self._read_stderr, daemon=True),
                         threading.Thread(target=self._read_stdout, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_stderr(self):
        for line in self.process.stderr:
            self.stderr.append(line.rstrip("\n"))
            self._lines.put(self.stderr[-1])
        self._lines.put(None)

    def _read_stdout(self):
        self.stdout = self.process.stdout.read()

    def wait_for(self, text: str) -> None:
        try:
            while (line := self._lines.get(timeout=EXIT_S)) is not None:
                if text in line:
                    return
        except queue.Empty:
            self.process.kill()
            raise AssertionError(f"the client did not print {text!r}: {self.stderr}") from None
        raise AssertionError(f"the client exited before printing {text!r}: {self.stderr}")

    def result(self) -> tuple[int, str, list[str]]:
        """(exit code, stdout, stderr's non-empty lines) once the client exits."""
        try:
            self.process.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the client did not exit; stderr so far: {self.stderr}") from None
        finally:
            for reader in self._readers:
                reader.join()
        return self.process.returncode, self.stdout, [line for line in self.stderr if line.strip()]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + EXIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def assert_one_line_failure(result, *expected: str) -> None:
    code, _, stderr = result
    assert code == 1 and len(stderr) == 1, stderr
    assert all(text in stderr[0] for text in expected), stderr


class FakeServer:
    """A /v1/realtime server that sends session.created, records what the client sends, and then either
    never answers (`close_after` None), or closes the connection with that code after the first append, or
    answers the final commit with the events `answer`."""

    def __init__(self, close_after: int | None = None, answer: list[dict] = ()):
        from websockets.sync.server import serve

        self.received: list[dict] = []
        self.connections = 0
        self.close_after = close_after
        self.answer = answer
        self.server = serve(self._handle, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/v1/realtime"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handle(self, ws):
        from websockets import ConnectionClosed

        self.connections += 1
        ws.send(json.dumps({"type": "session.created", "id": "sess-0"}))
        with contextlib.suppress(ConnectionClosed):  # the client may go without a close handshake
            for message in ws:
                self.received.append(json.loads(message))
                if self.close_after and self.received[-1]["type"] == "input_audio_buffer.append":
                    ws.close(self.close_after, "closed by the test")
                if self.received[-1].get("final"):
                    for event in self.answer:
                        ws.send(json.dumps(event))

    def types(self) -> list[str]:
        return [event["type"] + ("(final)" if event.get("final") else "") for event in self.received]

    def close(self):
        self.server.shutdown()


# -- realtime_client.py -----------------------------------------------------------------------------------
def test_realtime_client_transcribes_a_file(server, wavs):
    code, stdout, stderr = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", server.url(),
                                  "--api-key", API_KEY, "--fast").result()
    assert code == 0, stderr
    heard = set(stdout.split())
    assert sum(word in heard for word in sample_words()) >= len(sample_words()) - 2, stdout


def test_realtime_client_an_empty_file_is_one_line_error(server, wavs):
    result = Client("realtime_client.py", str(wavs / "empty.wav"), "--url", server.url(), "--api-key", API_KEY,
                    "--fast").result()
    assert_one_line_failure(result, "empty.wav", "no audio")


def test_realtime_client_a_wrong_model_ends_the_run(server, wavs):
    result = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", server.url(), "--api-key", API_KEY,
                    "--model", "no-such-model", "--fast").result()
    assert_one_line_failure(result, "model_not_found", "no-such-model")


def test_realtime_client_a_server_close_is_one_line(wavs):
    fake = FakeServer(close_after=4000)
    try:
        result = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", fake.url, "--model", "m").result()
    finally:
        fake.close()
    assert_one_line_failure(result, "the server closed the connection: 4000 closed by the test")


@pytest.mark.parametrize("name, content, expected", [
    ("missing.wav", None, "cannot read {path}: No such file or directory"),
    ("notes.wav", b"not audio\n", "cannot read {path} as audio: Format not recognised"),
], ids=["missing", "not-audio"])
def test_realtime_client_an_unreadable_file_is_one_line(tmp_path, name, content, expected):
    """Both were soundfile tracebacks; the file is read before anything connects."""
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    result = Client("realtime_client.py", str(path), "--url", "ws://127.0.0.1:9/v1/realtime", "--model", "m").result()
    assert_one_line_failure(result, expected.format(path=path))


def test_realtime_client_an_http_url_is_one_line_naming_the_websocket_url(wavs):
    """websockets takes only ws:// and wss:// (an http:// URL was an InvalidURI traceback)."""
    fake = FakeServer()
    try:
        http_url = fake.url.replace("ws://", "http://")
        result = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", http_url, "--model", "m").result()
    finally:
        fake.close()
    assert_one_line_failure(result, f"use --url {fake.url}")
    assert fake.connections == 0


@pytest.mark.parametrize("url, expected", [
    ("ws://127.0.0.1:18434:x/v1/realtime", "Port could not be cast to integer value as '18434:x'"),
    ("ws://[::1/v1/realtime", "Invalid IPv6 URL"),
    ("ws://127.0.0.1:99999/v1/realtime", "Port out of range 0-65535"),
    ("ws:///v1/realtime", "no host"),
], ids=["port-not-a-number", "open-bracket", "port-out-of-range", "no-host"])
@pytest.mark.parametrize("model", [[], ["--model", "m"]], ids=["model-from-server", "model-given"])
def test_realtime_client_a_malformed_websocket_url_is_one_line(wavs, url, expected, model):
    """A ws:// URL that urllib.parse cannot take apart (the messages are its own: urlsplit's .port and .hostname)
    was a traceback: http.client's InvalidURL or urllib's ValueError from GET /v1/models, or websockets'
    ValueError, which is not the InvalidURI the client caught. Nothing is asked of any server."""
    result = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", url, *model).result()
    assert_one_line_failure(result, f"--url {url}: ", expected)


def test_realtime_client_a_server_that_lists_no_model_is_one_line(wavs, tmp_path):
    """An HTTP server that is not a realtime server (here, a static one whose /v1/models is a web page): the
    client asked it for a model id and failed with a JSONDecodeError traceback."""
    import functools
    import http.server

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("<html>not a model list</html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"ws://127.0.0.1:{httpd.server_address[1]}/v1/realtime"
        result = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", url).result()
    finally:
        httpd.shutdown()
    assert_one_line_failure(result, "/v1/models listed no model; name one with --model")


def busy(server) -> bool:
    return any(conn.protocol.busy() for conn in list(server.state.connections))


def test_realtime_client_reports_a_transcript_the_server_ended_early(engine, wavs):
    """A server shutting down mid-file (SIGTERM: app.drain) ends the utterance itself and sends its done: the
    client printed that transcript and exited 0 as if it covered the whole file. It now prints it, then one line
    saying how much of the file the server transcribed, with the server's notice, and exits 1."""
    from jaxstream.serving.app import drain

    stopping = ServerThread(engine)
    try:
        client = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", stopping.url())  # at real time
        wait_until(lambda: busy(stopping), "the client's utterance never ran")
        # The drain ends the utterance 1.5 s later (half the deadline), then gives the server the other 1.5 s to
        # finish it (1 s was too little once, with 17 server modules running on the other worker).
        assert stopping.call(drain(stopping.app, 3.0)) is True
        code, stdout, stderr = client.result()
    finally:
        stopping.close()
    seconds = sample_audio().size / 16000
    assert code == 1 and len(stderr) == 1, stderr
    line = stderr[0]
    assert line.startswith("incomplete transcript: the server transcribed ") and "shutting down" in line, line
    assert f" s of the {seconds:.2f} s of audio in {wavs / 'speech.wav'}: " in line, line
    transcribed = float(line.split("transcribed ")[1].split(" s")[0])
    assert 0 < transcribed < seconds - 1, line  # the drain came a second or more before the end of the file
    assert f"the first {transcribed:.2f} s of audio received" in line, line
    heard, words = stdout.split(), set(sample_words())
    assert heard and sum(word in words for word in heard) >= len(heard) - 1, stdout


@pytest.mark.parametrize("usage, incomplete", [({"audio_seconds": 1.0}, True), ({}, False)],
                         ids=["jaxstream-usage", "vllm-usage"])
def test_realtime_client_compares_the_audio_the_server_transcribed_with_the_file(wavs, usage, incomplete):
    """A done whose usage says it covers less audio than the file (a server that ended the utterance without
    saying why) is an incomplete transcript too; vLLM's done does not say, and is taken as complete."""
    fake = FakeServer(answer=[{"type": "transcription.delta", "delta": "he who"},
                              {"type": "transcription.done", "text": "he who", "usage": usage}])
    try:
        result = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", fake.url, "--model", "m",
                        "--fast").result()
    finally:
        fake.close()
    code, stdout, stderr = result
    assert stdout.split() == ["he", "who"], stdout
    if incomplete:
        assert_one_line_failure(result, f"the server transcribed 1.00 s of the {sample_audio().size / 16000:.2f} s "
                                "of audio in")
    else:
        assert code == 0 and len(stderr) == 1 and "s of audio" in stderr[0], stderr


@pytest.mark.parametrize("value", ["0", "-5", "0.01", "nan", "inf", "x"])
def test_realtime_client_chunk_ms_must_be_a_positive_number_of_samples(wavs, value):
    """--chunk-ms 0 or -5 sent one sample per append; argparse now refuses it (exit 2), naming the option."""
    code, _, stderr = Client("realtime_client.py", str(wavs / "speech.wav"), "--url", "ws://127.0.0.1:9/v1/realtime",
                             "--model", "m", f"--chunk-ms={value}").result()
    assert code == 2 and stderr[-1].startswith("realtime_client.py: error: argument --chunk-ms: "), stderr
    assert "positive number of milliseconds" in stderr[-1] or "expected milliseconds" in stderr[-1], stderr


def client_args(script: str, wavs: Path, *args: str) -> list[str]:
    """The arguments of `script` that transcribe speech.wav (realtime_client.py) or the microphone, plus `args`."""
    return [str(wavs / "speech.wav"), *args, "--fast"] if script == "realtime_client.py" else list(args)


@pytest.mark.parametrize("script", ["realtime_client.py", "microphone_client.py"])
@pytest.mark.parametrize("model", [[], ["--model", "m"]], ids=["model-from-server", "model-given"])
@pytest.mark.parametrize("path, status", [("/v1/nothere", 404), ("/", 200)], ids=["no-route", "demo-page"])
def test_a_wrong_url_path_is_named(server, wavs, fake_sounddevice, script, model, path, status):
    """A path that is no WebSocket route of the server: the client blamed its model lookup ("the server refused
    GET /v1/models: HTTP 404"), or said "refused: HTTP 200"; it now asks the server's /v1/models and says the
    path of --url is wrong."""
    env = {"PYTHONPATH": str(fake_sounddevice), "FAKE_MICROPHONE": ""}
    args = client_args(script, wavs, "--url", server.url(path), "--api-key", API_KEY, *model)
    assert_one_line_failure(Client(script, *args, env=env).result(),
                            f"the server has no WebSocket route {path} (HTTP {status}): check the path of --url")


@pytest.mark.parametrize("script", ["realtime_client.py", "microphone_client.py"])
def test_a_refusal_at_capacity_is_the_servers_words(engine, wavs, fake_sounddevice, script):
    """A server at its connection limit answers the handshake with an `error` event: the client printed it as a
    Python dict ("refused: {'type': 'error', ...}"); it now prints its message and code."""
    from websockets.sync.client import connect

    full = ServerThread(engine, ServerConfig(limits=Limits(max_connections=1)))
    try:
        with connect(full.url()) as held:
            assert json.loads(held.recv(30))["type"] == "session.created"
            env = {"PYTHONPATH": str(fake_sounddevice), "FAKE_MICROPHONE": ""}
            result = Client(script, *client_args(script, wavs, "--url", full.url(), "--model", "m"), env=env).result()
    finally:
        full.close()
    assert_one_line_failure(result, "the server refused the session: The server is at its limit of 1 connections; "
                            "retry later (code capacity)")
    assert "{" not in result[2][0], result


# -- microphone_client.py ---------------------------------------------------------------------------------
def microphone(fake_sounddevice, *args: str, wav: Path | None = None) -> Client:
    env = {"PYTHONPATH": str(fake_sounddevice), "FAKE_MICROPHONE": str(wav) if wav else ""}
    return Client("microphone_client.py", *args, env=env)


def test_microphone_client_without_portaudio_fails_before_connecting(tmp_path):
    """sounddevice raises OSError on import when the PortAudio library is missing. The client used to find
    out inside the session (sys.exit with its reader running: an asyncio traceback, and a 1011 close on the
    server); it now says so in one line and never connects."""
    (tmp_path / "sounddevice.py").write_text('raise OSError("PortAudio library not found")\n')
    fake = FakeServer()
    try:
        result = microphone(tmp_path, "--url", fake.url, "--model", "m").result()
    finally:
        fake.close()
    assert_one_line_failure(result, "pip install sounddevice", "PortAudio library not found")
    assert fake.connections == 0


def test_microphone_client_transcribes_until_ctrl_c(server, wavs, fake_sounddevice):
    client = microphone(fake_sounddevice, "--url", server.url(), "--api-key", API_KEY, wav=wavs / "speech.wav")
    client.wait_for("microphone: played")
    client.process.send_signal(signal.SIGINT)
    code, stdout, stderr = client.result()
    assert code == 0, stderr
    final = stdout.split("final: ")[-1].split()
    assert sum(word in final for word in sample_words()) >= len(sample_words()) - 2, stdout


@pytest.mark.parametrize("model", [[], ["--model", "m"]], ids=["models-route", "websocket"])
def test_microphone_client_a_refused_key_is_one_line(server, fake_sounddevice, model):
    result = microphone(fake_sounddevice, "--url", server.url(), "--api-key", "wrong", *model).result()
    assert_one_line_failure(result, "HTTP 401")


def test_microphone_client_a_wrong_model_ends_the_run(server, fake_sounddevice):
    client = microphone(fake_sounddevice, "--url", server.url(), "--api-key", API_KEY, "--model", "no-such-model")
    code, _, stderr = client.result()
    assert code == 1 and "Traceback" not in "\n".join(stderr), stderr
    assert "model_not_found" in stderr[-1], stderr


def test_microphone_client_ctrl_c_before_any_audio(server, fake_sounddevice):
    """The fake microphone delivers nothing: Ctrl-C then ends the run without a final commit, which the
    server would refuse (input_audio_buffer_commit_empty)."""
    client = microphone(fake_sounddevice, "--url", server.url(), "--api-key", API_KEY)
    client.wait_for("listening")
    client.process.send_signal(signal.SIGINT)
    code, _, stderr = client.result()
    assert code == 1 and "Traceback" not in "\n".join(stderr), stderr
    assert stderr[-1] == "no audio was captured", stderr


def test_microphone_client_reports_a_transcript_the_server_ended_early(engine, wavs, fake_sounddevice):
    """A server shutting down ends the utterance itself: the final transcript is printed as it came, then one line
    with the server's notice, and the exit code is 1 (it was 0, as if the user had ended the utterance)."""
    from jaxstream.serving.app import drain

    stopping = ServerThread(engine)
    try:
        client = microphone(fake_sounddevice, "--url", stopping.url(), wav=wavs / "speech.wav")
        wait_until(lambda: busy(stopping), "the client's utterance never ran")
        assert stopping.call(drain(stopping.app, 2.0)) is True
        code, stdout, stderr = client.result()
    finally:
        stopping.close()
    assert code == 1 and "Traceback" not in "\n".join(stderr), stderr
    assert stdout.split("final: ")[-1].strip(), stdout
    assert stderr[-1].startswith("incomplete transcript: The server is shutting down"), stderr


def test_microphone_client_a_second_ctrl_c_stops_waiting(wavs, fake_sounddevice):
    """A server that never answers: the first Ctrl-C sends the final commit, the second ends the wait."""
    fake = FakeServer()
    try:
        client = microphone(fake_sounddevice, "--url", fake.url, "--model", "m", wav=wavs / "speech.wav")
        try:
            wait_until(lambda: "input_audio_buffer.append" in fake.types(), "no audio reached the server")
            client.process.send_signal(signal.SIGINT)
            wait_until(lambda: "input_audio_buffer.commit(final)" in fake.types(), "no final commit")
            client.process.send_signal(signal.SIGINT)
        except AssertionError:
            client.process.kill()
            raise
        code, _, stderr = client.result()
    finally:
        fake.close()
    assert code == 130 and "Traceback" not in "\n".join(stderr), stderr
