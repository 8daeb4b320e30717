"""jaxstream: a pure-JAX engine for realtime streaming-input inference."""
from jaxstream.lazy_exports import lazy_exports

__version__ = "0.1.0"

# Public name -> module; imported on first use so that `import jaxstream` stays fast (no jax import).
_LAZY = {
    "AsyncEngine": "jaxstream.engine.async_engine",
    "EngineConfig": "jaxstream.engine.config",
    "SamplingParams": "jaxstream.engine.requests",
    "StreamingInput": "jaxstream.engine.requests",
    "StructuredOutputsParams": "jaxstream.engine.requests",
    "RequestOutput": "jaxstream.engine.requests",
    "CompletionOutput": "jaxstream.engine.requests",
    "Logprob": "jaxstream.engine.requests",
    "RequestOutputKind": "jaxstream.engine.requests",
    "TranscriptionSession": "jaxstream.engine.transcription_session",
    "TranscriptionDelta": "jaxstream.engine.transcription_session",
    "TranscriptionDone": "jaxstream.engine.transcription_session",
    "TranscriptionUsage": "jaxstream.engine.transcription_session",
    "WordTiming": "jaxstream.engine.transcription_session",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
