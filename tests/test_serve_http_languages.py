"""The `language` a transcription request names, on each HTTP route that takes one, driven over loopback by real
clients (the openai SDK, aiohttp): a code vLLM takes is accepted (OpenAI's 57 as they are, the rest of Whisper's
language map with a warning logged, as vLLM logs one) and verbose_json names its language; anything else is refused
with the parameter named. Also the words of a Mode B finish refused for missing chunks."""
import io
import json
import logging

import aiohttp
import openai
import pytest
import soundfile

from jaxstream.serving import languages
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

SESSIONS = "/v1/streaming_input/sessions"
SHORT = 8000  # samples: 0.5 s, enough for a transcription to run to its end
WARNINGS_FROM = "jaxstream.serving.http_transcriptions"


def test_the_languages_are_vllms():
    """OpenAI's 57 (vLLM's ISO639_1_SUPPORTED_LANGS) and the rest of Whisper's map (its ISO639_1_OTHER_LANGS and,
    since vLLM reads the map itself, Cantonese); Irish is in neither, and vLLM refuses it too."""
    assert (len(languages.SUPPORTED), len(languages.OTHER)) == (57, 43)
    assert {"bn", "la", "yue", "haw", "jw"} <= set(languages.OTHER)
    assert not set(languages.SUPPORTED) & set(languages.OTHER)
    assert languages.find_language("ga") is None and languages.find_language(" Haitian Creole ") == "ht"
    whisper = pytest.importorskip("transformers.models.whisper.tokenization_whisper")  # the bench extra
    assert {**languages.SUPPORTED, **languages.OTHER} == whisper.LANGUAGES


@pytest.fixture(scope="module")
def wav(audio):
    buffer = io.BytesIO()
    soundfile.write(buffer, audio[:SHORT], 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=120)


def warned(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == WARNINGS_FROM and record.levelno == logging.WARNING]


@pytest.mark.parametrize("language, name, warning", [
    ("bn", "bengali", "language 'bn' (bengali) is not one of OpenAI's transcription languages"),
    ("LA", "latin", "language 'la' (latin)"), ("yue", "cantonese", "language 'yue' (cantonese)"),
    ("haw", "hawaiian", "language 'haw' (hawaiian)"), ("Bengali", "bengali", "language 'bn' (bengali)"),
    ("fr", "french", None),
])
def test_a_language_vllm_takes_is_accepted_and_named(client, model, wav, caplog, language, name, warning):
    """These were 400s (only OpenAI's 57 were taken), where vLLM takes them with a warning that results may be
    less accurate."""
    caplog.set_level(logging.WARNING, logger=WARNINGS_FROM)
    result = client.audio.transcriptions.create(model=model, file=("short.wav", wav), response_format="verbose_json",
                                                language=language, languages=["yue", "en"])
    assert result.language == name
    messages = warned(caplog)
    if warning is None:  # French is one of OpenAI's: only the Cantonese of languages[] is warned of
        assert messages == ["languages[] 'yue' (cantonese) is not one of OpenAI's transcription languages: the "
                            "transcript may be less accurate"], messages
    else:
        assert messages[0].startswith(warning) and len(messages) == 2, messages


@pytest.mark.parametrize("fields, param", [
    ({"language": "ga"}, "language"), ({"language": "zz"}, "language"), ({"language": "en-GB"}, "language"),
    ({"languages": ["bn", "gaelic"]}, "languages[]"),
])
def test_a_language_vllm_refuses_is_a_400(client, model, wav, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.transcriptions.create(model=model, file=("short.wav", wav), **fields)
    assert (raised.value.body["code"], raised.value.body["param"]) == ("invalid_request", param)
    assert "ISO-639-1" in raised.value.body["message"]


def mode_a_body(params: dict, pcm) -> bytes:
    chunk = {"modality": "audio", "payload": encode_pcm16_base64(pcm), "end_of_input": True}
    return b"".join(json.dumps(line).encode() + b"\n" for line in (params, chunk))


@pytest.mark.parametrize("language, refused", [("bn", False), ("Cantonese", False), ("", False), ("klingon", True),
                                               (5, True)])
async def test_mode_a_checks_its_language_as_the_upload_does(server, model, audio, caplog, language, refused):
    """Mode A's parameters line took any `language` unchecked; it is checked as the upload's field is, and refused
    as its other parameters are (422). An empty one is absent, as the upload's empty field is (it was a 422)."""
    caplog.set_level(logging.WARNING, logger=WARNINGS_FROM)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), headers={"X-Streaming-Input": "true"},
                             data=mode_a_body({"model": model, "language": language}, audio[:SHORT])) as response:
            if refused:
                error = (await response.json())["error"]
                assert (response.status, error["code"], error["param"]) == (422, "invalid_request", "language")
                return
            assert response.status == 200
            text = await response.text()
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["type"] == "transcript.text.done", text[-300:]
    assert len(warned(caplog)) == (1 if language else 0)  # bn and Cantonese are outside OpenAI's list


@pytest.mark.parametrize("language, refused", [("yue", False), ("", False), ("xx", True), (["en"], True)])
async def test_mode_b_checks_its_language_as_the_upload_does(server, model, audio, language, refused):
    chunk = {"sequence_id": 0, "payload": encode_pcm16_base64(audio[:SHORT]), "end_of_input": True}
    body = {"model": model, "params": {"language": language}, "chunk": chunk}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url(SESSIONS, "http"), json=body) as response:
            status, created = response.status, await response.json()
        if refused:
            error = created["error"]
            assert (status, error["code"], error["param"]) == (422, "invalid_request", "params.language")
            return
        assert status == 201, created
        async with http.get(server.url(f"{SESSIONS}/{created['session_id']}/result", "http")) as response:
            assert response.status == 200 and "text" in await response.json()


async def test_a_finish_counts_the_missing_chunks_in_words(server, model, audio):
    """It said "1 chunks have not arrived"."""
    def chunk(seq: int, end: bool = False) -> dict:
        return {"sequence_id": seq, "payload": encode_pcm16_base64(audio[seq * 1600:(seq + 1) * 1600]),
                "end_of_input": end}

    async with aiohttp.ClientSession() as http:
        async def post(path: str, body: dict | None = None) -> tuple[int, dict]:
            async with http.post(server.url(path, "http"), json=body) as response:
                return response.status, await response.json()

        status, created = await post(SESSIONS, {"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        for sent, missing in ((1, "1 chunk has not arrived (sequence_id 0); send it before finishing"),
                              (3, "2 chunks have not arrived (sequence_id 0, 2); send them before finishing")):
            assert (await post(base + "/chunks", chunk(sent)))[0] == 202
            status, refused = await post(base + "/finish")
            assert (status, refused["error"]["code"], refused["error"]["message"]) == (409, "chunks_missing", missing)
        for seq in (0, 2):
            assert (await post(base + "/chunks", chunk(seq)))[0] == 202
        assert (await post(base + "/finish"))[0] == 200
        async with http.get(server.url(base + "/result", "http")) as response:
            assert response.status == 200
