"""The streaming-input engine: paged ring KV cache, compiled step programs, vLLM-semantics scheduler,
realtime transcription scheduler and the `AsyncEngine` API (design.md, specs/streaming_semantics.md)."""
from jaxstream.lazy_exports import lazy_exports

# Public name -> module, imported on first use: the CLI's parsers read a few constants without jax.
_LAZY = {
    "AsyncEngine": "jaxstream.engine.async_engine",
    "CompletionOutput": "jaxstream.engine.requests",
    "EngineConfig": "jaxstream.engine.config",
    "RequestOutput": "jaxstream.engine.requests",
    "RequestOutputKind": "jaxstream.engine.requests",
    "SamplingParams": "jaxstream.engine.requests",
    "StreamingInput": "jaxstream.engine.requests",
    "StructuredOutputsParams": "jaxstream.engine.requests",
    "TranscriptionDelta": "jaxstream.engine.transcription_session",
    "TranscriptionDone": "jaxstream.engine.transcription_session",
    "TranscriptionSession": "jaxstream.engine.transcription_session",
    "TranscriptionUsage": "jaxstream.engine.transcription_session",
    "WordTiming": "jaxstream.engine.transcription_session",
}

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "RequestOutput", "RequestOutputKind",
    "SamplingParams", "StreamingInput", "StructuredOutputsParams", "TranscriptionDelta", "TranscriptionDone",
    "TranscriptionSession", "TranscriptionUsage", "WordTiming",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
