"""Renaming checkpoint tensors by a table of rules, shared by converters and loaders."""

from __future__ import annotations

import re


def rename(weights: dict, table: list[tuple[str, str | None]]) -> tuple[dict, list[str]]:
    """Apply the first matching `(pattern, replacement)` to each key; None drops it on purpose.

    Returns the renamed tensors and the keys no rule covered (the caller decides
    how to report them: nothing is dropped silently).
    """
    out, unmapped = {}, []
    for key, value in weights.items():
        for pattern, repl in table:
            if re.fullmatch(pattern, key):
                if repl is not None:
                    out[re.sub(pattern, repl, key)] = value
                break
        else:
            unmapped.append(key)
    return out, unmapped
