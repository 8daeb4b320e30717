"""The streaming-input engine: paged ring KV cache, compiled step programs, vLLM-semantics scheduler,
realtime transcription scheduler and the `AsyncEngine` API (design.md, specs/streaming_semantics.md)."""
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import (
    CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams, StreamingInput,
)
from jaxstream.engine.transcription_session import (
    TranscriptionDelta, TranscriptionDone, TranscriptionSession, TranscriptionUsage, WordTiming,
)

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "RequestOutput", "RequestOutputKind",
    "SamplingParams", "StreamingInput", "TranscriptionDelta", "TranscriptionDone", "TranscriptionSession",
    "TranscriptionUsage", "WordTiming",
]
