"""`ServerConfig` and the server TOML (`jaxstream serve --config FILE_OR_PRESET`).

The TOML has up to four tables, each optional; command-line flags override it:

    model = "tiny"            # top level: what to serve
    [server]   host, port, compat, served_model_name, generation_config, chat_template, enable_auto_tool_choice,
               tool_call_parser, reasoning_parser, drain_timeout_s, the /ws rate limits (ws_*), CORS (allowed_origins,
               allowed_methods, allowed_headers, allow_credentials)
    [limits]   any field of serving.limits.Limits
    [engine]   any EngineConfig field with a plain value (max_sessions, default_delay_ms, buckets,
               quantization = "int8", ...)

A `chat_template` path is relative to the TOML's folder (`--chat-template` is relative to the working directory, as
vLLM's); a value that names no file and holds a jinja character is the template itself, as vLLM takes the flag. API
keys are not read from it (a config file is often committed); use --api-key-file or $JAXSTREAM_API_KEY.
"""
import dataclasses
import importlib.resources
import tomllib
from pathlib import Path

from jaxstream.engine.requests import GENERATION_CONFIGS
from jaxstream.errors import UserError
from jaxstream.models.chat_templates import is_inline_template
from jaxstream.serving.cors import check_origins
from jaxstream.serving.limits import Limits
from jaxstream.serving.reasoning_parsers import REASONING_PARSERS
from jaxstream.serving.tool_parsers import TOOL_PARSERS

COMPAT_MODES = ("strict", "vllm")
CORS_LISTS = ("allowed_origins", "allowed_methods", "allowed_headers")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # The model id clients name in session.update and see in /v1/models; None: the engine's source string.
    served_model_name: str | None = None
    # "strict": the protocol fixes of specs/realtime_protocols.md [B]; "vllm": vLLM 0.33's behaviour where a
    # fix would change what a client sees.
    compat: str = "strict"
    # vLLM's --generation-config: "auto" serves the sampling defaults the checkpoint's generation_config.json declares
    # to completions that omit those fields; "vllm" ignores the file.
    generation_config: str = "auto"
    # vLLM's --chat-template: the jinja template /v1/chat/completions renders conversations with, in place of the
    # tokenizer's (the text itself: `jaxstream serve` reads the file the flag or the TOML names; load_server_file makes
    # the TOML's path relative to the TOML). None: the tokenizer's.
    chat_template: str | None = None
    # vLLM's --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser: chat's tool_choice "auto" parses the
    # calls the model writes with the named parser (serving/tool_parsers.py), and its reasoning goes out apart from its
    # content (serving/reasoning_parsers.py). None: no parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    drain_timeout_s: float = 30.0  # SIGTERM: time running utterances get before their sockets close
    # The /ws envelope's rolling-window rate limits per connection (specs/realtime_protocols.md §5.6; the
    # guide's WS_* settings): messages but ping/pong/end, and cancels. 80 ms audio chunks alone are 750/min.
    ws_max_messages_per_window: int = 5000
    ws_message_window_s: float = 60.0
    ws_max_cancels_per_window: int = 50
    ws_cancel_window_s: float = 60.0
    # CORS (serving/cors.py), as vLLM's flags and defaults: the origins browser pages may call the API from, the
    # methods and request headers their preflights may ask for ("*": any), and whether their requests may carry
    # credentials. Any sequence of strings; kept as a tuple.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    limits: Limits = dataclasses.field(default_factory=Limits)

    def __post_init__(self):
        if not isinstance(self.host, str):
            raise ValueError(f"host must be a string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be a whole number in 0..65535, got {self.port!r}")
        if self.served_model_name is not None and not isinstance(self.served_model_name, str):
            raise ValueError(f"served_model_name must be a string, got {self.served_model_name!r}")
        if self.compat not in COMPAT_MODES:
            raise ValueError(f"compat must be one of {', '.join(COMPAT_MODES)}, got {self.compat!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be a string, got {self.chat_template!r}")
        if not isinstance(self.enable_auto_tool_choice, bool):
            raise ValueError(f"enable_auto_tool_choice must be true or false, got {self.enable_auto_tool_choice!r}")
        for name, parsers in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, name) is not None and getattr(self, name) not in parsers:
                raise ValueError(f"{name} must be one of {', '.join(parsers)}, got {getattr(self, name)!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")  # vLLM's words
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, "
                             f"got {self.generation_config!r}")
        if not self.drain_timeout_s > 0:
            raise ValueError("drain_timeout_s must be positive")
        for name in ("ws_max_messages_per_window", "ws_message_window_s", "ws_max_cancels_per_window",
                     "ws_cancel_window_s"):
            value, whole = getattr(self, name), name.startswith("ws_max_")
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive {'whole ' if whole else ''}number, got {value!r}")
        for name in CORS_LISTS:
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
                    isinstance(item, str) and item for item in value):
                raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))  # a TOML array or a flag's JSON list
        check_origins(self.allowed_origins)
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"allow_credentials must be true or false, got {self.allow_credentials!r}")

    @property
    def vllm_compat(self) -> bool:
        return self.compat == "vllm"


@dataclasses.dataclass(frozen=True)
class ServerFile:
    """A parsed server TOML: keyword arguments for each config, to be overridden by flags."""

    model: str | None
    server: dict
    limits: dict
    engine: dict


def load_server_file(name: str) -> ServerFile:
    """Reads a server TOML from a path or a preset name in jaxstream.configs; UserError on any mistake."""
    path = Path(name)
    if path.is_file():
        folder = path.parent
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError:
            raise UserError(f"{path} is not a server TOML: it is not UTF-8 text") from None
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    else:
        preset = importlib.resources.files("jaxstream.configs").joinpath(
            name if name.endswith(".toml") else f"{name}.toml")
        if not preset.is_file():
            raise UserError(f"config {name!r} is neither a file nor a preset in jaxstream.configs")
        text, source = preset.read_text(), f"preset {name}"
        folder = Path(str(preset)).parent
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: {exc}") from None
    unknown = set(data) - {"model", "server", "limits", "engine"}
    if unknown:
        raise UserError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}; expected model, [server], "
                        "[limits], [engine]")
    from jaxstream.engine.config import EngineConfig

    server = _table(data, "server", {"host", "port", "compat", "served_model_name", "generation_config",
                                     "chat_template", "enable_auto_tool_choice", "tool_call_parser",
                                     "reasoning_parser", "drain_timeout_s", "ws_max_messages_per_window",
                                     "ws_message_window_s", "ws_max_cancels_per_window", "ws_cancel_window_s",
                                     *CORS_LISTS, "allow_credentials"}, source)
    limits = _table(data, "limits", {f.name for f in dataclasses.fields(Limits)}, source)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"mesh", "compat"}
    engine = {key: _tuples(value) for key, value in _table(data, "engine", engine_fields, source).items()}
    if isinstance(server.get("chat_template"), str):
        server["chat_template"] = _beside(folder, server["chat_template"])
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise UserError(f"{source}: model must be a string")
    return ServerFile(model, server, limits, engine)


def _beside(folder: Path, template: str) -> str:
    """A [server] chat_template as a path relative to the TOML's folder, unless it is the template itself (a value
    that names no file there and holds a jinja character); `jaxstream serve` reads the file."""
    path = folder / template
    return template if is_inline_template(template) and not path.is_file() else str(path)


def _table(data: dict, name: str, allowed: set, source: str) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise UserError(f"{source}: {name} must be a table ([{name}])")
    unknown = set(table) - allowed
    if unknown:
        raise UserError(f"{source}: unknown key(s) in [{name}]: {', '.join(sorted(unknown))}; allowed: "
                        f"{', '.join(sorted(allowed))}")
    return dict(table)


def _tuples(value):
    """TOML arrays -> tuples (EngineConfig is frozen and hashable; its buckets are tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
