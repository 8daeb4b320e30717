"""Realtime transcription session API (see jaxstream/engine/transcription_session.py): `TranscriptionSession`,
its events `TranscriptionDelta` / `TranscriptionDone`, `WordTiming` and `TranscriptionUsage`."""
from jaxstream.engine.transcription_session import (
    TranscriptionDelta, TranscriptionDone, TranscriptionSession, TranscriptionUsage, WordTiming, word_timings,
)

__all__ = ["TranscriptionDelta", "TranscriptionDone", "TranscriptionSession", "TranscriptionUsage", "WordTiming",
           "word_timings"]
