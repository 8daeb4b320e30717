"""What a `session.update` (GA) or `transcription_session.update` (beta) of OpenAI's realtime transcription dialect
may set, and its checks (specs/realtime_protocols.md §4.3): the input format, the transcription settings, the
turn detection, the noise reduction and `include`. openai_realtime.py applies the result and documents the choices
(the delay names, what is validated but does not condition the model).

Everything is checked before anything changes: `parse_session_update` returns the changes of a valid update, or
raises ClientError for the first field that is not, and the session stays as it was."""
import functools

from jaxstream.serving import wire_json
from jaxstream.serving.languages import find_language
from jaxstream.serving.vad import TurnDetectionError, parse_turn_detection

DELAY_MS = {"minimal": 160, "low": 320, "medium": 480, "high": 960, "xhigh": 2400}
FORMAT_RATES = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
NOISE_REDUCTION = ("near_field", "far_field")
LOGPROBS = "item.input_audio_transcription.logprobs"
INCLUDABLE = (LOGPROBS,)  # what `session.include` may name


class ClientError(Exception):
    """A client mistake answered with an `error` event, the socket kept; its code is one of the client's
    (http_errors.ERROR_STATUS: invalid_request_error)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def parse_session_update(session, beta: bool, server) -> dict:
    """The changes the update's `session` asks for, by setting: format, transcription (the fields it names),
    turn_detection, noise_reduction, include. `server` (app.ServerState) says which models are served."""
    if not isinstance(session, dict):
        raise ClientError("invalid_event", "Missing required field: session", "session")
    if beta:
        fields = {"format": ("input_audio_format", session),
                  "transcription": ("input_audio_transcription", session),
                  "turn_detection": ("turn_detection", session),
                  "noise_reduction": ("input_audio_noise_reduction", session)}
    else:
        if session.get("type", "transcription") != "transcription":
            raise ClientError("invalid_value", "Only session.type \"transcription\" is served here",
                              "session.type")
        audio = _object(session, "audio", "session.audio")
        audio_in = _object(audio, "input", "session.audio.input")
        fields = {name: (name, audio_in) for name in ("format", "transcription", "turn_detection",
                                                      "noise_reduction")}
    parsers = {"format": functools.partial(_parse_format, beta=beta),
               "transcription": functools.partial(_parse_transcription, server=server),
               "turn_detection": _parse_turn_detection, "noise_reduction": _parse_noise_reduction}
    changes = {}
    for name, (key, holder) in fields.items():
        if key in holder:
            param = f"session.{key}" if beta else f"session.audio.input.{key}"
            changes[name] = parsers[name](holder[key], param)
    if "include" in session:
        include = session["include"] or []
        if not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
            raise ClientError("invalid_type", "include must be a list of strings", "session.include")
        unknown = [x for x in include if x not in INCLUDABLE]
        if unknown:
            raise ClientError("invalid_value", f"include: unknown value {wire_json.shown(unknown[0])}; supported: "
                              + ", ".join(INCLUDABLE), "session.include")
        changes["include"] = list(dict.fromkeys(include))
    return changes


def _parse_format(value, param: str, beta: bool) -> str:
    if beta:
        if not isinstance(value, str) or value not in BETA_FORMATS:
            raise ClientError("invalid_value", f"input_audio_format must be one of {', '.join(BETA_FORMATS)}",
                              param)
        return BETA_FORMATS[value]
    if not isinstance(value, dict) or not isinstance(value.get("type"), str) or value["type"] not in FORMAT_RATES:
        raise ClientError("invalid_value", f"format.type must be one of {', '.join(FORMAT_RATES)}", param)
    rate = value.get("rate", FORMAT_RATES[value["type"]])
    if rate != FORMAT_RATES[value["type"]] or isinstance(rate, bool):
        raise ClientError("invalid_value", f"{value['type']} is served at {FORMAT_RATES[value['type']]} Hz "
                          f"only, got {wire_json.shown(rate)}", f"{param}.rate")
    return value["type"]


def _parse_transcription(value, param: str, server) -> dict:
    if value is None:
        return {"model": server.model_id, "language": None, "prompt": "", "delay": None}
    if not isinstance(value, dict):
        raise ClientError("invalid_type", "transcription must be an object", param)
    changes = {}
    if "model" in value:
        model = value["model"]
        if not isinstance(model, str) or not server.serves_model(model, allow_empty=False):
            raise ClientError("model_not_found", f"The model `{wire_json.shown(model)}` does not exist; this server "
                              f"serves `{server.model_id}`", f"{param}.model")
        changes["model"] = model
    for key in ("language", "prompt"):
        if key in value:
            if value[key] is not None and not isinstance(value[key], str):
                raise ClientError("invalid_type", f"{key} must be a string", f"{param}.{key}")
            if key == "language" and value[key] and find_language(value[key]) is None:  # as the HTTP route
                raise ClientError("invalid_value", f"Invalid language {wire_json.shown(value[key])}: give the audio's "
                                  "language in ISO-639-1 format, such as `en`", f"{param}.language")
            changes[key] = value[key]
    if "delay" in value:
        delay = value["delay"]
        if delay is not None and (not isinstance(delay, str) or delay not in DELAY_MS):
            raise ClientError("invalid_value", f"delay must be one of {', '.join(DELAY_MS)}", f"{param}.delay")
        changes["delay"] = delay
    return changes


def _parse_turn_detection(value, param: str) -> dict | None:
    try:
        return parse_turn_detection(value)
    except TurnDetectionError as exc:
        raise ClientError("invalid_value", str(exc), f"{param}.{exc.field}" if exc.field else param) from None


def _parse_noise_reduction(value, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in NOISE_REDUCTION:
        raise ClientError("invalid_value", "noise_reduction.type must be near_field or far_field", param)
    return value["type"]


def _object(holder: dict, key: str, param: str) -> dict:
    value = holder.get(key, {})
    if not isinstance(value, dict):
        raise ClientError("invalid_type", f"{param} must be an object", param)
    return value
