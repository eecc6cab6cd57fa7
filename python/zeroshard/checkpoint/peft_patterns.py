"""peft's per-layer ``alpha_pattern`` / ``rank_pattern`` lookup, without regular expressions from a checkpoint.

peft (0.21.2, ``peft.utils.other.get_pattern_key``) picks, for a layer ``current_key`` such as
``transformer.h.0.attn.c_attn``, the first key for which ``re.match(rf"(.*\\.)?({key})$", current_key)`` succeeds. A
checkpoint is hostile input, and a key such as ``(a+)+b`` makes that match take exponential time (issue 18, case 4),
so no key read from a checkpoint is ever compiled here.

Rule: only **plain names** are accepted: a key made of ASCII letters, digits, ``_``, ``-`` and ``.``, optionally
starting with ``^`` (peft's own documented example, ``'^model.decoder.layers.0.encoder_attn.k_proj'``) and ending
with ``$``. Such a key is matched with exactly the result peft's regular expression gives, by a comparison that is
linear in the key's length: the layer name must end with the key, with each ``.`` of the key matching any character
but a newline (as in the regular expression), and what comes before must be empty or end with a ``.`` (empty only,
with ``^``). Any other key (a character class, a quantifier, a group, an escape) is refused with
:class:`ValueError` naming it; re-save the adapter config with the layers' plain names (one key per layer, or a
common suffix such as ``attn.c_attn``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["pattern_value"]

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _plain(key: Any, setting: str) -> tuple[str, bool]:
    """``(name, anchored)`` of a plain-name key (see the module docstring).

    Raises:
        ValueError: ``key`` is not a plain name (named, with the fix).
    """
    if isinstance(key, str):
        name = key.removeprefix("^").removesuffix("$")
        if name and len(name) <= 4096 and all(c in _NAME_CHARS for c in name):
            return name, key.startswith("^")
    shown = repr(key)[:80] + ("..." if len(repr(key)) > 80 else "")
    raise ValueError(
        f"LoRA {setting} key {shown} in the checkpoint's index is not a plain layer name: consolidate --hf does not "
        "compile regular expressions from a checkpoint. Use plain dotted names (letters, digits, '_', '-', '.'; an "
        "optional leading '^'), e.g. 'h.0.attn.c_attn' or 'attn.c_attn': set the adapter's "
        f"LoraConfig.{setting} to the layers' names and save the checkpoint again"
    )


def _matches(name: str, anchored: bool, layer: str) -> bool:
    """``re.match(rf"(.*\\.)?({key})$", layer)`` for a plain-name key, in time linear in ``len(name)``."""
    ends = [len(layer)] + ([len(layer) - 1] if layer.endswith("\n") else [])  # `$` also matches before a final \n
    for end in ends:
        start = end - len(name)
        if start < 0 or (anchored and start != 0):
            continue
        if start > 0 and (layer[start - 1] != "." or "\n" in layer[: start - 1]):  # `(.*\.)?`: `.` skips no \n
            continue
        if all(k == c if k != "." else c != "\n" for k, c in zip(name, layer[start:end])):
            return True
    return False


def pattern_value(patterns: Any, layer: str, default: Any, setting: str) -> Any:
    """peft's value for ``layer`` (the HF model's module name, e.g. ``transformer.h.0.attn.c_attn``) from
    ``patterns`` (``{key: value}``, in saved order): the value of the first key that matches, else ``default``.

    Every key is checked (not only those before the match), so a checkpoint with a non-plain key is refused whatever
    the layer. Values must be finite real numbers (``int`` or ``float``).

    Raises:
        ValueError: ``patterns`` is not a mapping, a key is not a plain name, or a value is not a finite number; the
            message names ``setting`` (``alpha_pattern``) and the key.
    """
    if not patterns:
        return default
    if not isinstance(patterns, dict):
        raise ValueError(f"LoRA {setting} in the checkpoint's index is {type(patterns).__name__}, not a mapping")
    keys = [(key, *_plain(key, setting)) for key in patterns]
    for key, value in patterns.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"LoRA {setting}[{key!r}] in the checkpoint's index is {value!r}: not a finite number")
    for key, name, anchored in keys:
        if _matches(name, anchored, layer):
            return patterns[key]
    return default
