"""Realtime transcription session API (see jaxstream/engine/transcription.py): `TranscriptionSession`,
its events `TranscriptionDelta` / `TranscriptionDone`, `WordTiming` and `TranscriptionUsage`."""
from jaxstream.engine.transcription import (
    TranscriptionDelta, TranscriptionDone, TranscriptionSession, TranscriptionUsage, WordTiming, word_timings,
)

__all__ = ["TranscriptionDelta", "TranscriptionDone", "TranscriptionSession", "TranscriptionUsage", "WordTiming",
           "word_timings"]
