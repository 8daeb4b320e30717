"""JSON text as the server sends it, on WebSockets and in SSE events.

Compact, with non-ASCII characters as UTF-8, as pydantic's `model_dump_json` (vLLM) writes it. A client's
own string can come back in an event (an unknown type, a model name, an id) and may hold a lone UTF-16
surrogate: `"\\ud800"` is valid JSON, but such a string has no UTF-8 form, so the frame could not be sent
and the connection died. Such a text is written with ASCII escapes instead, as the client wrote it. A client's
value echoed in an error message is cut short (`shown`): a frame may hold megabytes.
"""
import json


def dumps(data) -> str:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return json.dumps(data, separators=(",", ":"))
    return text


def shown(value, limit: int = 64) -> str:
    """`value` as an error message echoes it, cut to `limit` characters."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."
