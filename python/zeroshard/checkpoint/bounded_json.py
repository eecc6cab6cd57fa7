"""JSON from a checkpoint directory, with its size and nesting depth bounded before it is parsed.

``json.loads`` recurses once per nesting level, so a file of ``[[[[...`` raises ``RecursionError`` (or, nested a
little less, makes every later recursive walk of it fail, the trainer state's decoder included); and a huge file is
read whole into memory. Here the file's size is checked against a limit before it is read, the parser's
``RecursionError`` becomes a named error, and the parsed value's depth is measured without recursion and bounded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zeroshard.checkpoint.safe_paths import CheckpointError, read_bounded

MAX_DEPTH = 100  # far above what a save writes (an index nests 4 levels, a Lightning trainer state about 30)
MAX_BYTES = 256 << 20  # 256 MiB: an index of a million parameters is about 100 MiB


def depth(value: Any, stop_beyond: int | None = None) -> tuple[int, str]:
    """The nesting depth of a parsed JSON value (0 for a scalar, 1 for ``[]``), walked without recursion, and the key
    path of the deepest container (``a.b[3]``); with ``stop_beyond``, the first container found deeper than that."""
    deepest, where, todo = 0, "", [(value, 1, "")]
    while todo:
        node, level, at = todo.pop()
        if isinstance(node, dict):
            children = [(v, level + 1, f"{at}.{k}" if at else str(k)) for k, v in node.items()]
        elif isinstance(node, list):
            children = [(v, level + 1, f"{at}[{i}]") for i, v in enumerate(node)]
        else:
            continue
        if level > deepest:
            deepest, where = level, at
            if stop_beyond is not None and level > stop_beyond:
                break
        todo.extend(children)
    return deepest, where


def loads(data: bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(data)``, refused when nested deeper than ``max_depth``; ``where`` names the file in errors.

    Raises:
        CheckpointError: nested too deep (naming the key where, when the parser got that far), or not valid UTF-8
            JSON.
    """

    def too_deep(found: str) -> CheckpointError:
        return CheckpointError(f"{where} nests {found}, more than the {max_depth} levels a checkpoint file may have")

    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:  # json's parser recurses per level, and stops cleanly at the interpreter's limit
        raise too_deep("deeper than Python's JSON parser can go") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({str(e)[:200]})") from None
    found, at = depth(value, stop_beyond=max_depth)
    if found > max_depth:
        raise too_deep(
            f"more than {max_depth} levels deep at key {at if len(at) < 300 else at[:150] + ' ... ' + at[-150:]}"
        )
    return value


def read(directory: Path, name: str, listed_in: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in the regular file ``directory/name`` (a plain name, not a link: :mod:`.safe_paths`).

    Raises:
        FileNotFoundError: missing. CheckpointError: a link, larger than ``max_bytes``, deeper than ``max_depth``, or
            not valid JSON (naming the file).
    """
    data = read_bounded(directory, name, max_bytes, listed_in)
    return loads(data, f"sharded checkpoint {directory}: {name}", max_depth)
