"""Errors that reach users as one clear line (CLI stderr, HTTP 4xx, protocol `error` events)."""


class UserError(Exception):
    """A mistake in what the user gave us (missing file, bad corpus, unsupported audio, offline hub id)."""
