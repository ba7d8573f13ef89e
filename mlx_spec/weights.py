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


def fp8_tile(weight: tuple, scale: tuple) -> int | None:
    """The square tile (32, 64, 128, ...) of an FP8 weight's block-scale grid, None if none fits.

    Only powers of two are tried: two of them that give the same grid (ceil division)
    assign every weight row and column to the same scale, so the answer is unique."""
    (rows, cols), (srows, scols) = weight[-2:], scale[-2:]
    tile = 32
    while tile <= 2 * max(rows, cols):
        if -(-rows // tile) == srows and -(-cols // tile) == scols:
            return tile
        tile *= 2
    return None


def fp8_blocks_to_mxfp8(key: str, weight, scale):
    """A block-scaled FP8 weight (e4m3 bytes [rows, cols], one ue8m0 scale per square
    tile, as DeepSeek ships them) -> MLX mxfp8 (`weight` as uint32, one scale per 32
    values of a row): the same numbers, repacked. `key` names the tensor in errors."""
    import mlx.core as mx

    tile = fp8_tile(weight.shape, scale.shape)
    if tile is None or weight.shape[-1] % 32:
        raise ValueError(
            f"{key}: a scale grid {tuple(scale.shape)} for the FP8 weight {tuple(weight.shape)} "
            "fits no square tile (32x32, 64x64, 128x128, ...) over 32-wide groups; the "
            "checkpoint is damaged or in an unknown FP8 layout")
    rows, cols = weight.shape
    scales = mx.repeat(mx.repeat(scale, tile, axis=0), tile // 32, axis=1)[:rows, : cols // 32]
    return weight.view(mx.uint32), scales
