"""Renaming checkpoint tensors by a table of rules, shared by converters and loaders."""

from __future__ import annotations

import json
import re
from pathlib import Path


def rename(weights: dict, table: list[tuple[str, str | None]]) -> tuple[dict, list[str]]:
    """Apply the first matching `(pattern, replacement)` to each key; None drops it on purpose.

    Returns the renamed tensors and the keys no rule covered (the caller decides
    how to report them: nothing is dropped silently). Two keys renamed to one name (aliases of
    one tensor, e.g. with and without a `model.` prefix) are refused: one would overwrite the other.
    """
    out, unmapped, source = {}, [], {}
    for key, value in weights.items():
        for pattern, repl in table:
            if re.fullmatch(pattern, key):
                if repl is not None:
                    name = re.sub(pattern, repl, key)
                    if name in source:
                        raise ValueError(f"tensors {source[name]!r} and {key!r} both name {name!r}: the "
                                         "checkpoint holds two copies of one tensor; remove the stray one")
                    out[name], source[name] = value, key
                break
        else:
            unmapped.append(key)
    return out, unmapped


def shard_files(folder: Path, index_name: str, pattern: str, error: type = ValueError) -> list[Path]:
    """The shards a sharded checkpoint's index (`index_name`) lists, all present, else every file
    of `folder` matching `pattern`; a damaged index or a missing shard is refused by name."""
    index = folder / index_name
    if not index.is_file():
        return sorted(folder.glob(pattern))
    try:
        where = json.loads(index.read_text()).get("weight_map")
    except (ValueError, UnicodeDecodeError, AttributeError):
        where = None
    if not isinstance(where, dict) or not where:
        raise error(f"{index}: no 'weight_map' naming the shards; download the checkpoint again")
    shards = sorted(set(where.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise error(f"{folder}: shard(s) {missing[:3]} listed in {index_name} are missing: download them")
    return [folder / s for s in shards]


def read_file(f: Path, load, error: type = ValueError):
    """`load()` of weight file `f`; a file that cannot be read (MLX reports a truncated
    safetensors as RuntimeError) is named with what is wrong with it and the fix."""
    try:
        return load()
    except (RuntimeError, OSError) as e:
        from .load_errors import safetensors_problem

        why = safetensors_problem(f) if f.suffix == ".safetensors" else None
        raise error(f"{f} {why or f'cannot be read ({e})'}: download it again") from None


def merged_shards(folder: Path, files: list[Path], read, error: type = ValueError) -> dict:
    """`read(file)` of every file, merged; a name in two files is refused (a stray copy would
    otherwise replace the real tensor, whichever file is read last)."""
    out, where = {}, {}
    for f in files:
        part = read(f)
        twice = sorted(set(part) & set(out))
        if twice:
            raise error(f"{folder}: tensor(s) {twice[:3]} are in more than one weight file ({f.name} and "
                        f"{where[twice[0]].name}); remove the stray copy")
        out.update(part)
        where.update(dict.fromkeys(part, f))
    return out


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


def quantize_as_stored(net, weights: dict) -> None:
    """Quantize the modules of `net` whose tensors carry `.scales`, each with the bits, group
    size and mode its tensors say (as mlx-lm's loader does; a checkpoint may mix modes)."""
    import mlx.nn as nn
    from mlx_lm.utils import infer_quant_config

    nn.quantize(net, class_predicate=lambda path, m: (
        hasattr(m, "to_quantized") and f"{path}.scales" in weights
        and infer_quant_config(path, m, weights)))


def check_fit(want: dict, weights: dict, what: str, hint: str, where: str = "",
              source=lambda key: key) -> None:
    """Refuse, by name, the first tensor of `weights` that is missing from, foreign to or
    misshaped for the parameters `want` ({key: array}) of the module built from the config.
    `what` names the tensors ("DeepSeek-V4"), `where` prefixes the message (the folder),
    `source(key)` says where a missing parameter would come from in the checkpoint."""
    for key in sorted(set(want) - set(weights)):
        raise ValueError(f"{where}{what} tensor {source(key)} is missing, expected shape "
                         f"{tuple(want[key].shape)}; {hint}")
    for key in sorted(set(weights) - set(want)):
        raise ValueError(f"{where}unexpected {what} tensor {key} {tuple(weights[key].shape)}: "
                         f"no such parameter in the module built from the config; {hint}")
    for key, value in want.items():
        if tuple(weights[key].shape) != tuple(value.shape):
            raise ValueError(f"{where}{what} tensor {key} has shape "
                             f"{tuple(weights[key].shape)}, expected {tuple(value.shape)} from "
                             f"the config; {hint}")
        if _floating(value) and not _floating(weights[key]):
            raise ValueError(f"{where}{what} tensor {key} is {weights[key].dtype}, not floating point "
                             "(an FP8 or quantized tensor without its scales, read as raw bytes): "
                             "use a checkpoint stored in bfloat16, float16 or float32, or dequantize it")


def _floating(a) -> bool:
    import mlx.core as mx

    return mx.issubdtype(a.dtype, mx.floating)
