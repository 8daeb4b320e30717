"""The error every layer raises for a mistake in what the user gave (a missing file, a bad checkpoint, an
offline hub id). It lives here, below the engine and the CLI, so the model loaders can raise it without
importing upward; `jaxstream.errors` re-exports it. Messages name the problem, not a command-line flag:
the caller (the CLI, a server) adds how to fix it in its own terms."""


class UserError(Exception):
    """A mistake in what the user gave us (missing file, bad corpus, unsupported audio, offline hub id)."""
