"""jaxstream: a pure-JAX engine for realtime streaming-input inference."""
import importlib

__version__ = "0.1.0"

# Public name -> module; imported on first use so that `import jaxstream` stays fast (no jax import).
_LAZY = {
    "AsyncEngine": "jaxstream.engine.async_engine",
    "EngineConfig": "jaxstream.engine.config",
    "SamplingParams": "jaxstream.engine.requests",
    "StreamingInput": "jaxstream.engine.requests",
    "RequestOutput": "jaxstream.engine.requests",
    "CompletionOutput": "jaxstream.engine.requests",
    "RequestOutputKind": "jaxstream.engine.requests",
    "TranscriptionSession": "jaxstream.engine.transcription_session",
    "TranscriptionDelta": "jaxstream.engine.transcription_session",
    "TranscriptionDone": "jaxstream.engine.transcription_session",
    "TranscriptionUsage": "jaxstream.engine.transcription_session",
    "WordTiming": "jaxstream.engine.transcription_session",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
