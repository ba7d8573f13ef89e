"""Shared pieces of every head converter: read a checkpoint, rename by table, check, write.

A converter is a key-mapping table plus a few format rules. This module does
the rest the same way for all of them:

* `resolve_source`   a local folder, or a Hugging Face repo id (downloaded);
* `read_config` / `read_tensors`   config.json and every tensor (safetensors,
  sharded or not; `pytorch_model.bin` through `converters.torch_bin`, which
  never executes pickled code);
* `rename`           apply a `[(regex, replacement | None)]` table; a source
  key no rule covers is an error (nothing is silently dropped);
* `check_shapes`     every expected tensor present with its exact shape;
* `write_head`       config.json + model.safetensors (optionally quantized),
  built in a hidden sibling folder and renamed at the end (`staging_dir`), so
  a failed conversion leaves nothing behind and an existing folder is refused
  unless `force`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
from pathlib import Path
from typing import Iterator

HEAD_FORMAT_VERSION = 1


class ConversionError(ValueError):
    """A checkpoint that cannot be converted: the message names the problem and the fix."""


def resolve_source(src: str | Path) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id, downloaded (cached)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConversionError(f"{src} is a file; give the checkpoint's folder")
    if str(src).count("/") != 1 or str(src).startswith((".", "/", "~")):
        raise ConversionError(f"no folder at {src} (and it is not a Hugging Face repo id 'org/name')")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "pytorch_model*.bin"]
    return Path(snapshot_download(str(src), allow_patterns=patterns))


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}): download it again") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds a JSON {type(config).__name__}, not the object of a model config")
    return config


def read_tensors(folder: Path) -> dict:
    """Every tensor of the checkpoint in `folder`, as MLX arrays (lazily loaded)."""
    import mlx.core as mx

    from mlx_spec.weights import merged_shards, read_file, shard_files

    def merged(files: list, load) -> dict:
        return merged_shards(folder, files, lambda f: read_file(f, lambda: load(f), ConversionError),
                             ConversionError)

    folder = Path(folder)
    files = shard_files(folder, "model.safetensors.index.json", "*.safetensors", ConversionError)
    if files:
        return merged(files, lambda f: mx.load(str(f)))
    # Only the model's own .bin files: training_args.bin and optimizer states are not weights.
    bins = shard_files(folder, "pytorch_model.bin.index.json", "pytorch_model*.bin", ConversionError)
    if bins:
        from .torch_bin import load_torch_bin

        return merged(bins, load_torch_bin)
    raise ConversionError(f"{folder} has no *.safetensors or *.bin weights")


def rename(weights: dict, table: list[tuple[str, str | None]]) -> dict:
    """Apply the first matching `(pattern, replacement)`; None drops the key on purpose."""
    from mlx_spec.weights import rename as apply_rules

    try:
        out, unmapped = apply_rules(weights, table)
    except ValueError as e:  # two keys renamed to one name
        raise ConversionError(str(e)) from None
    if unmapped:
        raise ConversionError(
            f"{len(unmapped)} tensor(s) in the checkpoint match no known key, e.g. "
            f"{unmapped[:5]}; is this the right --format?"
        )
    return out


def int_fields(cfg: dict, where: str, required: tuple, optional: tuple = ("num_key_value_heads", "head_dim")) -> None:
    """Refuse a config whose `required` fields are not positive integers, or whose `optional`
    ones are given as anything else (a "2" read as a string would multiply, not count)."""
    bad = [k for k in required if not (isinstance(cfg.get(k), int) and cfg[k] > 0)]
    bad += [k for k in optional if cfg.get(k) is not None and not (isinstance(cfg[k], int) and cfg[k] > 0)]
    if bad:
        raise ConversionError(f"{where}: {', '.join(f'{k}={cfg.get(k)!r}' for k in bad)} must be positive "
                              "integers; is it the head's own config.json, undamaged?")


def rekey(weights: dict, name) -> dict:
    """`weights` under the names `name(key)` gives; two keys given one name are refused (two
    copies of one tensor in the checkpoint, e.g. with and without a prefix)."""
    out, source = {}, {}
    for key, value in weights.items():
        new = name(key)
        if new in out:
            raise ConversionError(f"tensors {source[new]!r} and {key!r} both name {new!r}: the checkpoint "
                                  "holds two copies of one tensor; remove the stray one")
        out[new], source[new] = value, key
    return out


ID_TABLES = ("draft_to_target", "token_ordering")  # integer tensors: token id tables


def check_shapes(weights: dict, expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Every expected key present with its exact shape, and nothing else; every weight floating
    point (an FP8 or integer-quantized tensor read as is would be its raw bytes)."""
    import mlx.core as mx

    missing = [k for k in expected if k not in weights]
    if missing:
        raise ConversionError(f"{what}: missing tensor(s) {missing[:5]}")
    def floating(w) -> bool:  # MLX arrays as read; NumPy ones where tests build checkpoints
        return mx.issubdtype(w.dtype, mx.floating) if isinstance(w, mx.array) else w.dtype.kind == "f"

    raw = [f"{k} ({weights[k].dtype})" for k in expected if not k.endswith(ID_TABLES) and not floating(weights[k])]
    if raw:
        raise ConversionError(f"{what}: tensor(s) {raw[:5]} are not floating point (an FP8 or quantized "
                              "checkpoint?); convert the release stored in bfloat16, float16 or float32, "
                              "or dequantize it first")
    bad = [
        f"{k}: {tuple(weights[k].shape)} (expected {tuple(s)})"
        for k, s in expected.items()
        if tuple(weights[k].shape) != tuple(s)
    ]
    if bad:
        raise ConversionError(f"{what}: misshaped tensor(s) " + "; ".join(bad[:5]))
    extra = [k for k in weights if k not in expected]
    if extra:
        raise ConversionError(f"{what}: unexpected tensor(s) {extra[:5]}")


def refuse_existing(out_dir: Path, force: bool, error: type = ConversionError) -> None:
    """Refuse an existing `out_dir` unless `force`; and even then unless it is an earlier output
    (a folder holding `config.json`) or an empty folder: `--force` must never delete a folder of
    anything else (a parent folder given by mistake, a folder of the user's own files)."""
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if not force:
        raise error(f"{out_dir} already exists; use --force (force=True) to replace it")
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise error(f"{out_dir} exists and is not a folder; --force replaces only an earlier output "
                    "folder: choose another output path")
    if not (out_dir / "config.json").is_file() and any(out_dir.iterdir()):
        raise error(f"{out_dir} is not an earlier output (no config.json) and is not empty; --force "
                    "would delete what it holds, so it replaces only earlier outputs: choose a new folder")
    run = [n for n in ("train.json", "data.jsonl", "checkpoint.safetensors") if (out_dir / n).exists()]
    if run:
        raise error(f"{out_dir} holds a training run ({', '.join(run)}); --force never replaces one: "
                    "choose a new folder")


@contextlib.contextmanager
def staging_dir(out_dir: Path, force: bool = False, error: type = ConversionError) -> Iterator[Path]:
    """A hidden sibling of `out_dir` to build in, renamed to `out_dir` only on success (an existing
    one that `refuse_existing` allows is moved aside first, put back if the rename fails, and
    deleted after)."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir, force, error)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would stick to the final folder; mkdir honours the umask.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        refuse_existing(out_dir, force, error)  # it may have appeared (or changed) while we worked
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{secrets.token_hex(4)}"
            out_dir.rename(old)
        try:
            tmp.rename(out_dir)
        except BaseException:
            if old is not None:  # put the previous folder back
                old.rename(out_dir)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:  # KeyboardInterrupt too: never leave a half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_head(
    out_dir: Path,
    config: dict,
    weights: dict,
    *,
    quantize_bits: int | None = None,
    group_size: int = 64,
    force: bool = False,
) -> Path:
    """Write a converted head folder; 2-D Linear weights are quantized when asked."""
    import mlx.core as mx

    config = dict(config)
    if quantize_bits is not None:
        if quantize_bits not in (4, 8):
            raise ConversionError(f"--q-bits must be 4 or 8, got {quantize_bits}")
        if group_size not in (32, 64, 128):
            raise ConversionError(f"--q-group-size must be 32, 64 or 128, got {group_size}")
        quantized = {}
        for key, w in weights.items():
            if _quantizable(key, w, group_size):
                base = key[: -len(".weight")]
                q, s, b = mx.quantize(w, group_size=group_size, bits=quantize_bits)
                quantized.update({key: q, f"{base}.scales": s, f"{base}.biases": b})
            else:
                quantized[key] = w
        weights = quantized
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    with staging_dir(Path(out_dir), force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)


def _quantizable(key: str, w, group_size: int) -> bool:
    # Linear and embedding weights; norms, biases and id tables stay as they are.
    return key.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group_size == 0


def target_identity(model_config: dict) -> dict:
    """What a head records about the target it was converted for (checked at load)."""
    text = model_config.get("text_config", model_config)
    return {
        k: text.get(k, model_config.get(k))
        for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    }
