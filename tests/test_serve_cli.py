"""`jaxstream serve` as a user runs it (a subprocess: 503 while compiling, ready line, API key from the
environment, SIGTERM drain), its configuration errors, and the server's small pure pieces (audio
decoding, API keys, config files)."""
import asyncio
import base64
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import websockets

from jaxstream.cli import main
from jaxstream.errors import UserError
from jaxstream.serving.audio_codecs import AudioDecodeError, decode_pcm16_base64, encode_pcm16_base64
from jaxstream.serving.auth import load_api_keys
from jaxstream.serving.config import ServerConfig, load_server_file
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import RealtimeClient, sample_audio, sample_words

ROOT = Path(__file__).resolve().parents[1]
SMALL_ENGINE = """
[engine]
max_sessions = 2
batch_buckets = [2]
realtime_step_buckets = [1]
realtime_prefill_buckets = [[2, 40]]
"""


class Lines:
    """A subprocess's stdout, line by line, with timeouts."""

    def __init__(self, stream):
        self._lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} after {timeout:g} s; saw {self.seen}") from None
            if line is None:
                raise AssertionError(f"the server exited before printing {text!r}; saw {self.seen}")
            self.seen.append(line)
            if text in line:
                return line


@pytest.mark.slow
async def test_serve_reports_ready_after_compiling_and_drains_on_sigterm(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text(SMALL_ENGINE)
    env = {**os.environ, "JAXSTREAM_API_KEY": "s3cret", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxstream", "serve", "--host", "127.0.0.1", "--port", "0", "--config", str(config),
         "--drain-timeout", "20", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = Lines(process.stdout)
        listening = lines.wait_for("listening on http://", 60)
        base = listening.split("listening on ")[1].split(";")[0]
        ws_url = base.replace("http://", "ws://") + "/v1/realtime"
        key = {"Authorization": "Bearer s3cret"}
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/health") as response:
                assert response.status == 503 and (await response.json())["status"] == "loading"
            lines.wait_for("ready: ", 180)
            lines.wait_for("try: python examples/realtime_client.py", 5)
            async with http.get(base + "/health") as response:
                assert response.status == 200
            async with http.get(base + "/v1/models") as response:
                assert response.status == 401
                assert set((await response.json())["error"]) == {"message", "type", "param", "code"}
            async with http.get(base + "/v1/models", headers=key) as response:
                model = (await response.json())["data"][0]["id"]
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(ws_url)
        client = await RealtimeClient.connect(ws_url, additional_headers=key)
        await client.update(model)
        assert (await client.event())["type"] == "session.updated"
        audio = sample_audio()
        await client.commit()
        await client.append(audio[:20000])
        await asyncio.sleep(0.3)  # the server holds the running utterance when the signal comes
        process.send_signal(signal.SIGTERM)
        lines.wait_for("draining", 10)
        await client.append(audio[20000:])
        await client.commit(final=True)
        done = (await client.until("transcription.done"))[-1]
        heard, words = set(done["text"].split()), sample_words()  # the utterance finished across the drain
        assert sum(word in heard for word in words) >= len(words) - 2, done["text"]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await client.event(10)
        assert closed.value.rcvd.code == 1001
        assert process.wait(30) == 0
        lines.wait_for("stopped", 5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


TEXT_ENGINE = """
[engine]
max_sessions = 4
page_size = 16
batch_buckets = [4]
prefill_buckets = [[4, 8]]
max_num_batched_tokens = 64
"""


@pytest.mark.slow
def test_serve_with_a_text_lm_suggests_a_completion_that_works_as_printed(tmp_path):
    """The "try:" line used to be the realtime client, which a text LM cannot serve; it is now a completion
    (curl), run here exactly as printed. The oracle is OpenAI's completion object (`text_completion`)."""
    import json
    import shlex
    import shutil

    from test_engine_text_model import LLAMA, word_level_tokenizer

    if shutil.which("curl") is None:
        pytest.skip("the suggestion is a curl command")
    directory = tmp_path / "llama"
    shutil.copytree(LLAMA, directory)
    word_level_tokenizer(directory / "tokenizer.json", 256)
    config = tmp_path / "server.toml"
    config.write_text(TEXT_ENGINE)
    env = {key: value for key, value in os.environ.items() if key != "JAXSTREAM_API_KEY"}
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxstream", "serve", str(directory), "--host", "127.0.0.1", "--port", "0",
         "--config", str(config), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        lines = Lines(process.stdout)
        assert "/v1/completions" in lines.wait_for("ready: ", 180)
        suggestion = lines.wait_for("try: ", 5).split("try: ", 1)[1]
        argv = shlex.split(suggestion)
        assert argv[0] == "curl" and "realtime" not in suggestion, suggestion
        done = subprocess.run([*argv, "--silent", "--show-error", "--fail"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        completion = json.loads(done.stdout)
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] >= 1
        assert isinstance(completion["choices"][0]["text"], str)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("argv, message", [
    (["serve", "--delay-ms", "100"], "--delay-ms 100"),
    (["serve", "--config", "no-such-config"], "neither a file nor a preset"),
    (["serve", "--api-key", ""], "API key is empty"),
    (["serve", "--idle-timeout", "0"], "idle_timeout_s must be positive"),
    (["serve", "--compat", "vllm", "--port", "70000"], "port must be a whole number in 0..65535, got 70000"),
])
def test_configuration_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("jaxstream serve: error:")


def test_a_fractional_count_in_a_server_toml_is_a_one_line_mistake(tmp_path, capsys):
    # It used to start a server that answered every request with a 500 (the per-key window raised).
    path = tmp_path / "s.toml"
    path.write_text("[limits]\nmax_requests_per_minute_per_key = 10.5\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "max_requests_per_minute_per_key must be a whole number, got 10.5" in err and err.count("\n") == 1


@pytest.mark.parametrize("toml, message", [
    ('[server]\nport = "18123"\n', "port must be a whole number in 0..65535, got '18123'"),  # was a traceback
    ("[server]\nport = 18123.5\n", "port must be a whole number in 0..65535, got 18123.5"),  # listened on 18123
    ("[server]\nhost = 5\n", "host must be a string, got 5"),
    ("[server]\nserved_model_name = 7\n", "served_model_name must be a string, got 7"),  # no request matched
    ('[engine]\ndefault_delay_ms = "480"\n', "default_delay_ms must be a whole number of milliseconds, got '480'"),
    ('[server]\ngeneration_config = "configs/"\n', "generation_config must be one of auto, vllm, got 'configs/'"),
    # Was "cannot load ..." after a server had started listening and loaded the model.
    ('[server]\nhost = "127.0.0.1"\nport = 0\n[engine]\nattention_impl = "pallas_tpu"\n',
     "bad server configuration: EngineConfig.attention_impl 'pallas_tpu' cannot run here"),
])
def test_wrong_types_in_a_server_toml_are_one_line_mistakes(tmp_path, capsys, toml, message):
    path = tmp_path / "s.toml"
    path.write_text(toml)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_server_toml(tmp_path):
    preset = load_server_file("server")
    assert preset.server["port"] == 8000 and preset.engine["max_sessions"] == 64
    assert Limits(**preset.limits) == Limits() and ServerConfig(**preset.server).compat == "strict"
    path = tmp_path / "s.toml"
    path.write_text('model = "tiny"\n[engine]\nrealtime_prefill_buckets = [[2, 40]]\n')
    parsed = load_server_file(str(path))
    assert parsed.model == "tiny" and parsed.engine == {"realtime_prefill_buckets": ((2, 40),)}
    for text, message in (("[limits]\nidle = 3\n", "unknown key(s) in [limits]: idle"),
                          ("api_key = 'x'\n", "unknown key(s) api_key"), ("[server\n", "s.toml")):
        path.write_text(text)
        with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            load_server_file(str(path))


def test_a_body_min_rate_of_0_in_a_server_toml_turns_the_rule_off(tmp_path, capsys):
    """TOML has no null: `body_min_rate = 0` is how a server file says "no minimum rate" (configs/server.toml),
    where `jaxstream serve` refused it with "limit body_min_rate must be positive, got 0"."""
    path = tmp_path / "s.toml"
    path.write_text("[limits]\nbody_min_rate = 0\n")
    assert Limits(**load_server_file(str(path)).limits).body_min_rate is None  # read_at_min_rate's "no rule"
    path.write_text("[limits]\nbody_min_rate = -500\n")  # a negative rate is still a mistake
    assert main(["serve", "--config", str(path)]) == 2
    assert "limit body_min_rate must be positive, got -500" in capsys.readouterr().err


def test_api_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("one\n\n  two  \n")
    assert load_api_keys(key_file=str(keys)) == ("one", "two")
    assert load_api_keys("k", environ={"JAXSTREAM_API_KEY": "env"}) == ("k",)
    assert load_api_keys(environ={"JAXSTREAM_API_KEY": "env"}) == ("env",)
    assert load_api_keys(environ={}) == ()
    with pytest.raises(UserError, match="cannot read"):
        load_api_keys(key_file=str(tmp_path / "missing"))


def test_pcm16_base64_decoding_is_strict():
    pcm = np.array([0.0, 0.5, -0.5, -1.0], np.float32)
    encoded = encode_pcm16_base64(pcm)
    np.testing.assert_array_equal(decode_pcm16_base64(encoded, max_samples=4), pcm)
    wrapped = base64.encodebytes(base64.b64decode(encoded)).decode()  # MIME line breaks are fine
    np.testing.assert_array_equal(decode_pcm16_base64(wrapped, max_samples=4), pcm)
    for bad, reason in (("", "empty"), ("AAA", "base64"), ("AAAA*AAAA", "base64"), ("AAAA", "even"),
                        ("-_AA", "base64"), (encoded, "longer than 3")):
        with pytest.raises(AudioDecodeError, match=reason):
            decode_pcm16_base64(bad, max_samples=3)
    assert decode_pcm16_base64("AAAA*AAAA", max_samples=4, strict=False).size == 3  # vLLM's lax decoding
    with pytest.raises(AudioDecodeError, match="longer than"):  # refused before decoding anything
        decode_pcm16_base64("A" * 4_000_000, max_samples=1000)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_message_bytes"):
        Limits(max_append_seconds=600)
    with pytest.raises(ValueError, match="positive"):
        Limits(max_connections=0)
    with pytest.raises(ValueError, match="compat"):
        ServerConfig(compat="openai")



def test_a_binary_file_given_as_the_config_is_a_one_line_mistake(tmp_path, capsys):
    path = tmp_path / "x.wav"  # was a UnicodeDecodeError traceback
    path.write_bytes(bytes(range(256)))
    assert main(["serve", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"jaxstream serve: error: {path} is not a server TOML: it is not UTF-8 text\n"


def test_a_port_in_use_fails_before_the_model_starts_loading(monkeypatch, capsys):
    """The app began building the engine on its own thread before the site bound: when binding failed (a port
    in use, an unknown host) the process exited with that thread inside XLA, and about half such runs
    aborted ("terminate called after throwing an instance of ''", exit 134) after the one-line error.
    Nothing loads until the server listens."""
    import logging
    import socket

    from jaxstream.engine.async_engine import AsyncEngine

    loads = []

    def from_pretrained(model, **kwargs):
        loads.append(model)
        raise RuntimeError("this test loads no model")

    monkeypatch.setattr(AsyncEngine, "from_pretrained", from_pretrained)
    jaxstream_logger = logging.getLogger("jaxstream")
    level = jaxstream_logger.level  # serve sets its own
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            before = set(threading.enumerate())
            assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
        for thread in set(threading.enumerate()) - before:
            thread.join(60)  # the engine's build thread among them: whatever it was going to load, it has
    finally:
        jaxstream_logger.setLevel(level)
    assert loads == []
    assert capsys.readouterr().err == f"jaxstream serve: error: cannot listen on 127.0.0.1:{port}: " \
                                      "Address already in use\n"


@pytest.mark.parametrize("toml, flags, expected", [
    ("", [], "auto"),  # vLLM's default
    ('[server]\ngeneration_config = "vllm"\n', [], "vllm"),
    ('[server]\ngeneration_config = "vllm"\n', ["--generation-config", "auto"], "auto"),  # the flag wins
])
def test_generation_config_reaches_the_engine_from_the_flag_or_the_server_toml(monkeypatch, tmp_path, toml, flags,
                                                                               expected):
    import logging

    from jaxstream.engine.async_engine import AsyncEngine

    loads = []

    def from_pretrained(model, **kwargs):
        loads.append(kwargs["generation_config"])
        raise RuntimeError("this test loads no model")

    monkeypatch.setattr(AsyncEngine, "from_pretrained", from_pretrained)
    path = tmp_path / "s.toml"
    path.write_text(toml)
    level = logging.getLogger("jaxstream").level  # serve sets its own
    try:
        assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--config", str(path), *flags]) == 2
    finally:
        logging.getLogger("jaxstream").setLevel(level)
    assert loads == [expected]


# `jaxstream serve` whose model load is still going when the signal comes (it never ends), and which says when
# the interpreter tears itself down.
_SERVE_WHILE_LOADING = """
import atexit
import sys
import threading

from jaxstream.cli import main
from jaxstream.engine.async_engine import AsyncEngine


def from_pretrained(model, **kwargs):
    print("the load started", flush=True)
    threading.Event().wait()


AsyncEngine.from_pretrained = from_pretrained
atexit.register(lambda: print("interpreter teardown", flush=True))
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_while_the_model_loads_stops_the_server_without_tearing_down_the_load():
    """Ctrl-C (or SIGTERM) before the server was ready let the interpreter tear itself down with the engine's
    build thread inside XLA: some runs aborted ("terminate called after throwing an instance of ''", exit 134)
    after "stopped", depending on where the load was (3 s into the tiny model's, 1 run in 2). The server now
    leaves at once, with its status, when its load is still running."""
    process = subprocess.Popen([sys.executable, "-c", _SERVE_WHILE_LOADING, "serve", "--host", "127.0.0.1", "--port",
                                "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = Lines(process.stdout)
        lines.wait_for("the load started", 60)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        lines.wait_for("stopping: the model was still loading", 5)  # not a drain's "running utterances get ..."
        lines.wait_for("stopped", 5)
        with pytest.raises(AssertionError, match="exited before printing"):
            lines.wait_for("interpreter teardown", 5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _route_paths(line: str) -> set[str]:
    """The paths a ready line names: in URLs, and as bare `/paths`."""
    return set(re.findall(r"://[^/\s]+(/[\w/.-]*)", line)) | set(re.findall(r"(?:^|[\s(])(/[\w/.-]*)", line))


def test_the_ready_line_names_the_routes_the_app_serves():
    """The ready line listed /ws, SageMaker's route, /v1/models, /health and /metrics, not HTTP transcriptions,
    Kyutai's protocol, streaming-input sessions or the demo page. The oracle is the app's router."""
    from jaxstream.commands.serve import _ready_lines
    from jaxstream.serving.app import create_app

    app = create_app(ServerConfig(), engine_factory=lambda: None)
    routes = {route.resource.canonical for route in app.router.routes()}
    top_level = {path for path in routes if "{" not in path and not path.startswith("/static/")}
    aliases = {"/healthz", "/ping", "/v1/realtime/transcription_sessions"}  # of /health, of client_secrets (beta)
    ready, _ = _ready_lines("realtime", "tiny", "127.0.0.1", 8000)
    listed = _route_paths(ready)
    # The text routes, and the tokenizer's (which a speech model answers too, but its users seldom want).
    text_only = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    assert listed <= routes and top_level - listed == aliases | text_only, ready
    ready, _ = _ready_lines("text", "llama", "127.0.0.1", 8000)
    listed = _route_paths(ready)
    assert listed <= routes and {"/v1/completions", "/v1/chat/completions", "/v1/streaming_input/sessions",
                                 "/tokenize", "/v1/models"} <= listed, ready


@pytest.mark.slow
def test_the_suggested_client_command_works_when_the_key_was_a_flag(tmp_path):
    """`serve --api-key K` printed the client command without a key (it relied on $JAXSTREAM_API_KEY, unset
    when the key was a flag), and copied as printed it failed with HTTP 401. It now names where the key goes,
    without printing it: filled in, it is run here as a user would, against a server that requires the key."""
    import shlex

    from jaxstream.commands.serve import KEY_PLACEHOLDER, _ready_lines
    from jaxstream.serving.testing import ServerThread, shared_engine

    key = "sekrit-given-as-a-flag"
    server = ServerThread(shared_engine(), ServerConfig(api_keys=(key,)))
    try:
        _, suggestion = _ready_lines("realtime", server.state.model_id, "127.0.0.1", server.server.port,
                                     key_source="--api-key")
        command = suggestion.split("try: ", 1)[1]
        assert shlex.split(command, comments=True)[-2:] == ["--api-key", KEY_PLACEHOLDER], command
        env = {name: value for name, value in os.environ.items() if name != "JAXSTREAM_API_KEY"}
        done = subprocess.run(["bash", "-c", command.replace(KEY_PLACEHOLDER, key)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        heard, words = set(done.stdout.split()), sample_words()
        assert sum(word in heard for word in words) >= len(words) - 2, done.stdout
    finally:
        server.close()
