"""JSON files a checkpoint folder holds (shard indexes, configs) and safetensors headers, read within the limits."""

from __future__ import annotations

from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

from ..errors import ReadError
from ..safepickle import limits


def read_json(path: Path, what: str, max_bytes: int) -> object:
    """A JSON file, every failure a ReadError: too big, not UTF-8, not JSON, nested too deep, numbers too long."""
    import os
    import stat

    try:  # opened without blocking (a FIFO named as the index would wait for a writer), then read only if a file
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a link to /dev/zero has no end, and says it holds 0 bytes
            raise ReadError(f"{path}: {what} is not a regular file")
        if st.st_size > max_bytes:
            raise ReadError(f"{path}: {what} of {st.st_size:,} bytes, over the {max_bytes >> 20} MB limit")
        chunks, left = [], max_bytes + 1  # at most the limit: a file may grow after its size was read
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ReadError(f"{path}: {what} grew past the {max_bytes >> 20} MB limit while it was read")
        return parse_json(b"".join(chunks), path, what)
    except OSError as exc:
        raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


class _NotJson(ValueError):
    """A number JSON does not have, met by the strict reading."""


def _no_constant(name: str) -> float:
    raise _NotJson(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotJson(f"number {text[:40]} is out of range")
    return value


def parse_json(raw: bytes, path: Path, what: str, strict: bool = False, object_pairs_hook: Any = None) -> object:
    """`strict` reads as the safetensors library (serde_json) does: NaN, Infinity and a number past the largest
    double are refused (Python's json reads them as floats), and a nest 128 deep is too deep (serde stops there; the
    limit for other JSON files is one more). `object_pairs_hook` is json's, given the pairs of every object only
    when a key may be given twice (JSON keeps the last), by a second parse."""
    import json  # json's decoder: only where a JSON file or header is read (inspect of a torch zip reads none)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ReadError(f"{path}: {what} is not UTF-8") from None
    max_depth = limits.MAX_JSON_DEPTH - 1 if strict else limits.MAX_JSON_DEPTH
    # Parsed first, the depth then read off the value (a quarter of what a regex over the text costs); a text that
    # does not parse is measured as text, so a nest too deep is named as such whatever else is wrong with it.
    try:
        if strict:
            value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        else:
            value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; so is an integer of thousands
        depth = _json_depth(text, max_depth)     # of digits
        if depth > max_depth:
            raise ReadError(f"{path}: {what} nests {depth} levels deep; JSON readers stop at {max_depth}") from None
        if isinstance(exc, json.JSONDecodeError):
            raise ReadError(f"{path}: {what} is not valid JSON ({exc.msg} at {exc.pos})") from None
        if isinstance(exc, _NotJson):
            raise ReadError(f"{path}: {what} is not valid JSON ({exc})") from None
        raise ReadError(f"{path}: {what} holds a value no JSON reader accepts ({str(exc)[:80]})") from None
    depth, keys = _value_depth(value, max_depth)
    if depth > max_depth:
        depth = _json_depth(text, max_depth)
        raise ReadError(f"{path}: {what} nests {depth} levels deep; JSON readers stop at {max_depth}")
    if object_pairs_hook is not None and keys < text.count(":"):
        # Each pair has a colon outside the strings: with fewer keys than colons, a key may have been given twice
        # (or a string holds a colon); the hook then sees every object's pairs, in a second parse.
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite,
                           object_pairs_hook=object_pairs_hook)
    if has_lone_surrogate(value, text):
        raise ReadError(f"{path}: {what} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which JSON readers refuse")
    return value


def _value_depth(value: object, limit: int) -> tuple[int, int]:
    """How deep a parsed value's objects and arrays nest (as the brackets of its text do), and how many keys its
    objects hold, level by level, without recursion; counting stops past `limit`. Each level's items are gathered
    and typed by C loops (a safetensors header of 20,000 entries is 160,000 items), only the containers among them
    kept by a Python one."""
    from itertools import chain

    dicts = [value] if value.__class__ is dict else []
    lists = [value] if value.__class__ is list else []
    depth = keys = 0
    while (dicts or lists) and depth <= limit:
        depth += 1
        keys += sum(map(len, dicts))
        items = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))
        kinds = set(map(type, items))
        dicts = [x for x in items if x.__class__ is dict] if dict in kinds else []
        lists = [x for x in items if x.__class__ is list] if list in kinds else []
    return depth, keys


def _json_depth(text: str, limit: int = limits.MAX_JSON_DEPTH) -> int:
    """How deep brackets nest (strings skipped), without recursion: a 200,000-deep header must not crash the parser.
    The strings and everything but brackets are cut out by one regex, and the depth is the highest running sum."""
    if text.count("[") + text.count("{") <= limit:
        return 0
    import re
    from itertools import accumulate

    # a string (an unterminated one runs to the end, as a parser reads it), or any run of other non-bracket text
    brackets = re.sub(r'"[^"\\]*(?:\\(?:.|$)[^"\\]*)*(?:"|$)|[^"\[\]{}]+', "", text, flags=re.S)
    return max(accumulate(1 if ch in "[{" else -1 for ch in brackets), default=0)


def has_lone_surrogate(value: object, text: str) -> bool:
    """Text decoded from UTF-8 holds no surrogate: one can only come from a \\uD800-\\uDFFF escape, so the values
    are walked only when the text has one (a pair that makes one character is fine)."""
    import re

    if not re.search(r"\\u[dD][89a-fA-F]", text):
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False
