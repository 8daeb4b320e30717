"""Malformed HTTP requests in the server's log: one WARNING line each, not aiohttp's ERROR with a traceback.

aiohttp answers a request it cannot parse (a header with a control character, a chunk size that is not hex, a
20 KB request line, a Content-Length that is not a number) with a plain 400, and logs it on `aiohttp.server` at
ERROR with the parser's traceback, which says nothing about the server. A scanner or a broken client could fill
the log with them and set off alerts that key on ERROR; uvicorn, vLLM's server, logs one WARNING for the same
input. (aiohttp already logs a first request with a bad method, as a TLS handshake sent to a plain port, at
DEBUG.)
"""
import logging

from aiohttp.http_exceptions import BadHttpMessage


class MalformedRequests(logging.Filter):
    """Turns `aiohttp.server`'s report of a request it could not parse into one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage) and record.levelno > logging.WARNING:
            reason = (error.message or type(error).__name__).splitlines()[0]
            record.msg, record.args = f"{record.getMessage()}: malformed request answered 400: {reason}", ()
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.exc_info = record.exc_text = None
        return True


def quiet_malformed_requests() -> None:
    """Installs the filter once on `aiohttp.server` (process-wide, as aiohttp's logger is)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in logger.filters):
        logger.addFilter(MalformedRequests())
