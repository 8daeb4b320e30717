"""Starting an engine transcription session from a request or connection handler, safe against
cancellation, naming what ended one, and OpenAI's shape of token logprobs. Every protocol (WebSocket and
HTTP alike) uses these."""
import asyncio
import logging

from jaxstream.errors import EngineError
from jaxstream.models.audio import SAMPLING_RATE

logger = logging.getLogger(__name__)


async def start_session(engine, delay_ms, sample_rate: int = SAMPLING_RATE, *, max_audio_seconds: float | None):
    """`engine.start_transcription`, safe against cancellation: a session the engine creates after the
    caller was torn down (a client that went away mid-start) is aborted, never left holding engine
    capacity. `max_audio_seconds` is the most audio the session can take (the engine reserves memory for
    that much): a file's length, or the connection's audio limit."""
    task = asyncio.ensure_future(engine.start_transcription(delay_ms, sample_rate=sample_rate,
                                                            max_audio_seconds=max_audio_seconds))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_abort_orphan)
        raise


def _abort_orphan(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        asyncio.ensure_future(task.result().abort(reason="client_disconnected"))


def failure_of(connection_id: str, exc: Exception) -> tuple[str, str]:
    """(code, message) a protocol reports for an exception out of a session's event stream. An EngineError
    carries its own stable code; anything else is a bug, logged with its traceback, and reported without
    internals as `processing_error`."""
    if isinstance(exc, EngineError):
        logger.warning("%s: transcription failed: %s", connection_id, exc)
        return exc.code, str(exc) or type(exc).__name__
    logger.error("%s: the engine's event stream failed", connection_id, exc_info=exc)
    return "processing_error", "Internal error in the transcription"


def token_logprobs(tokenizer, token_ids, logprobs) -> list[dict]:
    """OpenAI's `logprobs` entries, `{token, logprob, bytes}`, for the text tokens among `token_ids` (control
    tokens, the stream's pads and word markers, carry no text and are left out). A byte-fallback piece of a
    multi-byte character has its raw `bytes` and a `token` of U+FFFD: joined, the bytes spell the text."""
    entries = []
    for token_id, logprob in zip(token_ids, logprobs):
        if not tokenizer.is_control(token_id):
            raw = tokenizer.token_bytes(token_id)
            entries.append({"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)})
    return entries
