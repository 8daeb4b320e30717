"""Incremental JSON for tool calls whose text arrives token by token (serving/tool_parsers.py).

`JsonReader` reads one JSON value from pieces of text, as events: containers opening and closing, object keys,
string values character by character, scalars, and the `,` / `:` between them, each with its nesting depth. It
accepts what `json.loads` accepts (NaN and Infinity included), and raises `JsonError` at the first character it
cannot.

`normal_text(event)` is the event's share of `json.dumps(value, ensure_ascii=False)`: the events of a value, mapped
and joined, are exactly that text. So a tool call's arguments stream as they complete and add up to the arguments
the whole output gives (`json.dumps(json.loads(...))`, vLLM's), whatever spacing or escapes the model wrote: a string
streams character by character, a number or `true` once it is whole. (A key written twice keeps both in the stream,
where `json.loads` keeps the last value.)
"""
import json

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_WHITESPACE = " \t\n\r"
_BARE_CHARS = frozenset("+-.0123456789eE" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class JsonError(ValueError):
    """Text that is not (the start of) a JSON value."""


class JsonReader:
    """One JSON value read from pieces of text. `feed(text)` gives the events the text completes and where in `text`
    the value ended (None while it goes on); `finish()` ends a value cut off by the end of the text (a bare number
    needs what follows it to end). Events are tuples `(kind, value, depth)`: `open` / `close` ("{" or "["; depth
    before it opens), `key` (the decoded key), `string_start`, `chars` (decoded characters of a string value),
    `string_end` (the whole decoded string), `scalar` (a number or literal as written), `,` and `:`."""

    def __init__(self):
        self._stack: list[list] = []  # [container, expected]: "{" expects key/colon/value/next; "[" value/next
        self._expected = "value"  # at the top level: "value", then "end"
        self._string: list[str] | None = None  # the decoded characters of the string being read
        self._key = False  # whether that string is an object's key
        self._escape: str | None = None  # an escape sequence begun in it
        self._high: str | None = None  # a \uD800-\uDBFF escape waiting for its low half
        self._bare: str | None = None  # a number or literal being read
        self._flushed = 0  # characters of `_string` that `chars` events carried
        self.done = False

    @property
    def depth(self) -> int:
        return len(self._stack)

    def feed(self, text: str) -> tuple[list[tuple], int | None]:
        events: list[tuple] = []
        if self.done:
            return events, 0
        for i, char in enumerate(text):
            part_of_value = self._char(char, events)
            if self.done:
                return events, i + part_of_value
        if self._string is not None and not self._key and len(self._string) > self._flushed:
            events.append(("chars", "".join(self._string[self._flushed:]), self.depth))
            self._flushed = len(self._string)
        return events, None

    def finish(self) -> list[tuple]:
        """The events a value that ends with the text completes (a bare number); JsonError if it is cut short."""
        events: list[tuple] = []
        if self._bare is not None and not self._stack:
            self._end_bare(events)
        if not self.done:
            raise JsonError("the text ends inside a JSON value")
        return events

    # -- one character ------------------------------------------------------------------------------------------
    def _char(self, char: str, events: list) -> bool:
        """Reads `char`; False when it ended a top-level number without being part of the value."""
        if self._string is not None:
            self._string_char(char, events)
            return True
        if self._bare is not None:
            if char in _BARE_CHARS:
                self._bare += char
                if self._bare in _LITERALS:
                    self._end_bare(events)  # no literal continues another: it is whole
                return True
            self._end_bare(events)
            if self.done:
                return False
        if char in _WHITESPACE:
            return True
        expected = self._stack[-1][1] if self._stack else self._expected
        if expected == "end":
            raise JsonError(f"unexpected {char!r} after the value")
        if expected in ("key", "key_or_close"):
            if char == '"':
                self._start_string(key=True)
            elif char == "}" and expected == "key_or_close":
                self._close(events)
            else:
                raise JsonError(f"expected an object key, got {char!r}")
        elif expected == "colon":
            if char != ":":
                raise JsonError(f"expected ':' after an object key, got {char!r}")
            self._stack[-1][1] = "value"
            events.append((":", None, self.depth))
        elif expected == "next":
            container = self._stack[-1][0]
            if char == ",":
                self._stack[-1][1] = "key" if container == "{" else "value"
                events.append((",", None, self.depth))
            elif char == ("}" if container == "{" else "]"):
                self._close(events)
            else:
                raise JsonError(f"expected ',' or the end of the {'object' if container == '{' else 'array'}, "
                                f"got {char!r}")
        else:  # a value (or, right after "[", the end of the array)
            if char == "]" and expected == "value_or_close":
                self._close(events)
            elif char in "{[":
                events.append(("open", char, self.depth))
                self._stack.append([char, "key_or_close" if char == "{" else "value_or_close"])
            elif char == '"':
                self._start_string(key=False)
                events.append(("string_start", None, self.depth))
            elif char in _BARE_CHARS:
                self._bare = char
            else:
                raise JsonError(f"expected a JSON value, got {char!r}")
        return True

    def _start_string(self, *, key: bool) -> None:
        self._string, self._key, self._flushed = [], key, 0

    def _string_char(self, char: str, events: list) -> None:
        if self._escape is not None:
            self._escape += char
            if self._escape[1] != "u":
                if char not in _ESCAPES:
                    raise JsonError(f"invalid escape {self._escape!r} in a JSON string")
                self._escape = None
                self._add(_ESCAPES[char])
            elif len(self._escape) == 6:
                try:
                    code = int(self._escape[2:], 16)
                except ValueError:
                    raise JsonError(f"invalid escape {self._escape!r} in a JSON string") from None
                self._escape = None
                self._add(chr(code))
        elif char == "\\":
            self._escape = "\\"
        elif char == '"':
            self._end_string(events)
        elif char < " ":
            raise JsonError("a control character inside a JSON string")
        else:
            self._add(char)

    def _add(self, char: str) -> None:
        """A decoded character; a surrogate pair given as two escapes is one character, as json.loads makes it."""
        if self._high is not None:
            high, self._high = self._high, None
            if "\udc00" <= char <= "\udfff":
                self._string.append(chr(0x10000 + ((ord(high) - 0xD800) << 10) + ord(char) - 0xDC00))
                return
            self._string.append(high)
        if "\ud800" <= char <= "\udbff":
            self._high = char
        else:
            self._string.append(char)

    def _end_string(self, events: list) -> None:
        if self._high is not None:
            self._string.append(self._high)
            self._high = None
        text, self._string = "".join(self._string), None
        if self._key:
            events.append(("key", text, self.depth))
            self._stack[-1][1] = "colon"
            return
        if len(text) > self._flushed:
            events.append(("chars", text[self._flushed:], self.depth))
        events.append(("string_end", text, self.depth))
        self._value_done()

    def _end_bare(self, events: list) -> None:
        token, self._bare = self._bare, None
        try:
            json.loads(token)
        except ValueError:
            raise JsonError(f"{token!r} is not a JSON number or literal") from None
        events.append(("scalar", token, self.depth))
        self._value_done()

    def _close(self, events: list) -> None:
        container = self._stack.pop()[0]
        events.append(("close", "}" if container == "{" else "]", self.depth))
        self._value_done()

    def _value_done(self) -> None:
        if self._stack:
            self._stack[-1][1] = "next"
        else:
            self._expected, self.done = "end", True


def normal_text(event: tuple) -> str:
    """The event's share of `json.dumps(value, ensure_ascii=False)` (its default separators ", " and ": ")."""
    kind, value, _ = event
    if kind in ("open", "close"):
        return value
    if kind in ("string_start", "string_end"):
        return '"'
    if kind == "chars":
        return json.dumps(value, ensure_ascii=False)[1:-1]
    if kind == "key":
        return json.dumps(value, ensure_ascii=False)
    if kind == "scalar":
        return json.dumps(json.loads(value), ensure_ascii=False)
    return ", " if kind == "," else ": "
