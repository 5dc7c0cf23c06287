"""One reader for JSON that comes from files: valid-but-hostile documents fail as JSONDecodeError like malformed ones.

Python's json module turns a document that is valid JSON but hostile into exceptions no caller expects:
an integer of more than 4,300 digits is a ValueError (int conversion limit), an array or object nested
some thousand levels deep a RecursionError, and a lone surrogate escape (`"\\ud800"`) parses into a
string that cannot be encoded (tokenizers and writers then fail with a TypeError or UnicodeEncodeError).
Every JSON and JSONL reader of gptoss goes through `parse_json` / `read_json`, which raise
`json.JSONDecodeError` for these as for a syntax error, so each caller's one-line "not valid JSON"
message covers them too. JSONL files are read line by line with `jsonl_lines`, which names the file and
line of a line that is not JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from gptoss_cli.errors import UsageError

# No number gptoss reads from JSON needs more digits (byte offsets and sizes are below 2**64: 20 digits);
# consumers check their own ranges below this.
MAX_INT_DIGITS = 40


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _TooLong(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(text)


class _TooLong(ValueError):
    pass


# A \uD800-\uDFFF escape: a pair decodes to one character, a lone one stays a surrogate. Only documents
# holding such an escape are walked, so ordinary text costs one regex scan.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) in `value` that UTF-8 cannot encode, as an escape; None when all can."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return "\\u%04x" % ord(item[exc.start])
    return None


class HostileJson(json.JSONDecodeError):
    """Valid JSON that gptoss will not parse; its message has no position (the whole document is the culprit)."""

    def __str__(self) -> str:
        return self.msg


def parse_json(text: str | bytes) -> Any:
    """json.loads with hostile-but-valid documents as json.JSONDecodeError (see the module docstring)."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")  # UnicodeDecodeError, as json.loads would raise
    try:
        value = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise HostileJson("arrays or objects nested too deeply", text, 0) from None
    except _TooLong as exc:
        raise HostileJson(str(exc), text, 0) from None
    if _SURROGATE_ESCAPE.search(text) and (bad := _lone_surrogate(value)) is not None:
        raise HostileJson(f"a lone surrogate {bad} in a string (text must be valid Unicode)", text, 0)
    return value


def read_json(path: str | Path) -> Any:
    """parse_json of a file's text (OSError and UnicodeDecodeError as reading raises them)."""
    return parse_json(Path(path).read_text())


@dataclass(frozen=True)
class JsonlLine:
    """One line of a JSONL file: its number (from 1), its size in bytes, and its JSON value unless it is blank."""

    number: int
    nbytes: int
    blank: bool
    value: Any = None


def strict_utf8(path: Path | str, error: Callable[[str], Exception] = UsageError) -> Callable[[bytes, int, int], str]:
    """A `decode` for jsonl_lines that refuses bytes that are not UTF-8 as error("PATH:LINE: invalid UTF-8 (why)")."""
    def decode(raw: bytes, number: int, offset: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{path}:{number}: invalid UTF-8 ({exc.reason})") from None
    return decode


def jsonl_lines(path: Path, decode: Callable[[bytes, int, int], str],
                not_json: str = "not a JSON object") -> Iterator[JsonlLine]:
    """Every line of the JSONL file `path`, blank ones included (callers count their bytes), streamed.

    decode(raw bytes, line number, byte offset of the line) -> its text, raising the caller's own error
    for bytes it refuses; a non-blank line that is not JSON is a UsageError "PATH:LINE: {not_json} (why)".
    """
    offset = 0
    with Path(path).open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            text = decode(raw, number, offset)
            offset += len(raw)
            if not text.strip():
                yield JsonlLine(number, len(raw), blank=True)
                continue
            try:
                value = parse_json(text)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{number}: {not_json} ({exc.msg})") from None
            yield JsonlLine(number, len(raw), blank=False, value=value)


__all__ = ["parse_json", "read_json", "jsonl_lines", "JsonlLine", "HostileJson", "MAX_INT_DIGITS"]
