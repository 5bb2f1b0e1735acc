"""JSON text rewritten as it streams into the form `json.dumps(value, ensure_ascii=False)`
writes: `", "` and `": "` between items, no other whitespace outside strings, strings
with only the escapes json.dumps writes, numbers as Python writes them back. A tool
call's arguments go out in this form whatever spacing the model chose (a grammar lets
it choose freely), and each piece goes out as soon as it is certain: a number when the
character after it comes, an escape when it is whole.

What is not JSON passes as written (a token that does not parse, an escape that does not
decode, a lone surrogate), so no text is lost and the output is always encodable.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"
_PUNCTUATION = {"{": "{", "}": "}", "[": "[", "]": "]", ",": ", ", ":": ": "}


def _string_text(text: str) -> str:
    """`text` as json.dumps writes it inside a string's quotes."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _token(token: str) -> str:
    """A number or literal as json.dumps writes it back; as written if it is neither."""
    try:
        return json.dumps(json.loads(token))
    except ValueError:
        return token


class JsonRewriter:
    """One JSON value's text in, its json.dumps form out, piece by piece."""

    def __init__(self) -> None:
        self.in_string = False
        self.escape = ""  # an escape begun in a string
        self.high = ""  # a \\uD8xx escape waiting for its low surrogate
        self.token = ""  # a number or literal not ended yet

    def feed(self, text: str) -> str:
        out: list[str] = []
        for char in text:
            if self.in_string:
                self._string_char(char, out)
            elif char in _PUNCTUATION or char == '"' or char in _WHITESPACE:
                if self.token:
                    out.append(_token(self.token))
                    self.token = ""
                if char == '"':
                    self.in_string = True
                    out.append(char)
                elif char in _PUNCTUATION:
                    out.append(_PUNCTUATION[char])
            else:
                self.token += char
        return "".join(out)

    def finish(self) -> str:
        """What was held at the text's end (a value cut short)."""
        out = [self.high, self.escape, _token(self.token) if self.token else ""]
        self.high = self.escape = self.token = ""
        return "".join(out)

    def _string_char(self, char: str, out: list[str]) -> None:
        if self.escape:
            self.escape += char
            if len(self.escape) == 2 and char != "u" or len(self.escape) == 6:
                self._escaped(out)
            return
        if self.high and char != "\\":
            out.append(self.high)  # a lone high surrogate stays as it was written
            self.high = ""
        if char == "\\":
            self.escape = char
        elif char == '"':
            self.in_string = False
            out.append(char)
        else:
            out.append(_string_text(char))

    def _escaped(self, out: list[str]) -> None:
        escape, self.escape = self.escape, ""
        try:
            decoded = json.loads(f'"{escape}"')
        except ValueError:
            out.append(self.high + escape)
            self.high = ""
            return
        code = ord(decoded) if len(decoded) == 1 else 0
        if 0xD800 <= code <= 0xDBFF:
            out.append(self.high)
            self.high = escape
        elif 0xDC00 <= code <= 0xDFFF:
            out.append(_string_text(json.loads(f'"{self.high}{escape}"')) if self.high else escape)
            self.high = ""
        else:
            out.append(self.high + _string_text(decoded))
            self.high = ""
