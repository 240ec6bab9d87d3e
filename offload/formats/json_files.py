"""Reading the JSON files a checkpoint or a user hands over (config.json, a safetensors header or index, a
tokenizer's config, a saved chat), so that whatever they hold ends in a value or one line: malformed text,
invalid UTF-8, nesting deeper than Python's recursion (a 100k-deep array), an integer past Python's digit limit
and a string that is not Unicode (a lone surrogate, which JSON's \\ud800 escape can write) are each refused with
`error(what ...)`, never a traceback; so is a device, a FIFO or a file past bounded_read.MAX_BYTES; a safetensors
index must map tensor names to file names.

Does not know: what a file means (its callers check the fields they read).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offload.formats.bounded_read import MAX_BYTES, read_bytes

MAX_DEPTH = 512          # deeper nesting is no real config; Python's own decoder overflows near 1000 levels


def parse_json(data: str | bytes, what: str, error: type[Exception] = ValueError) -> Any:
    """The value `data` holds; error(one line naming `what`) for anything that is not plain, sane JSON."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    try:
        value = json.loads(data)
    except RecursionError:
        raise error(f"{what} nests too deeply to read") from None
    except ValueError as e:                       # JSONDecodeError, and int() past sys.get_int_max_str_digits
        raise error(f"{what} is not valid JSON ({' '.join(str(e).split())[:160]})") from None
    bad, depth = _walk(value)
    if depth > MAX_DEPTH:
        raise error(f"{what} nests deeper than {MAX_DEPTH} levels; no real file does")
    if bad is not None:
        raise error(f"{what} holds a string that is not valid Unicode ({bad!r}: a lone surrogate)")
    return value


def read_json(path: Path, what: str | None = None, error: type[Exception] = ValueError,
              limit: int = MAX_BYTES) -> Any:
    """parse_json of a regular file's bytes, at most `limit` of them (bounded_read.read_bytes; OSError as
    raised: it names the file)."""
    what = what or str(path)
    return parse_json(read_bytes(path, what, error, limit), what, error)


def weight_map(index: Path, error: type[Exception] = ValueError) -> dict[str, str]:
    """A safetensors index's weight_map: tensor name -> file name, checked to be exactly that."""
    data = read_json(index, str(index), error)
    mapping = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                for k, v in mapping.items()):
        raise error(f"{index}: not a valid safetensors index (its weight_map must map tensor names to file names)")
    return mapping


def _walk(value: Any) -> tuple[str | None, int]:
    """(the first string, key or value, holding a lone surrogate, or None; the deepest nesting), without
    recursion."""
    todo, deepest = [(value, 0)], 0
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item[:40], deepest
        elif isinstance(item, dict):
            todo += [(x, depth + 1) for pair in item.items() for x in pair]
        elif isinstance(item, list):
            todo += [(x, depth + 1) for x in item]
    return None, deepest
