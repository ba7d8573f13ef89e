"""`mlx-spec convert gguf`: turn a llama.cpp GGUF file into a folder `mlx_lm.load` can open.

The `gguf` package reads the file and dequantizes every quant type; `gguf_arch` maps metadata
to config.json and tensors to Hugging Face names (undoing llama.cpp's weight transforms);
`gguf_tokenizer` rebuilds tokenizer.json. The model is then assembled with mlx-lm's own class for
the architecture (so a strict weight load proves the folder is loadable) and saved with mlx-lm's
`save_model`/`save_config`, optionally quantized with `quantize_model`.

Invariants: tensors are dequantized one at a time, so peak memory is about the output's size;
the folder appears atomically (built in a hidden sibling, renamed at the end), so a failed or
interrupted conversion leaves nothing behind. Non-goal: architectures other than llama, qwen2
and gemma3 (they fail with an error naming the architecture).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from converters.common import refuse_existing, staging_dir
from converters.gguf_arch import ArchError, build_config, hf_name, to_hf
from converters.gguf_tokenizer import TokenizerError, check_vocabulary, eos_token_ids, save_tokenizer

DTYPES = ("float32", "bfloat16", "float16")
# Bump when a conversion's output changes, so that caches built from it (the zoo's) are rebuilt.
FORMAT_VERSION = 1
Q_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize's affine mode accepts
Q_GROUPS = (32, 64, 128)  # the group sizes MLX's quantized matmuls take


class GGUFError(ValueError):
    """The GGUF file, or the requested output, cannot be converted (the message says why)."""


def convert(
    src: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the GGUF file `src` into the MLX model folder `out_dir`.

    Args:
        src: a GGUF file (any quant type the `gguf` package dequantizes).
        out_dir: the folder to create; refused if it exists, unless `force`.
        dtype: float type of the saved weights (and of the scales when quantizing).
        quantize: re-quantize the linear and embedding layers with MLX's affine quantization.
        q_bits, q_group_size: MLX quantization parameters.
        force: replace an existing `out_dir` (only once the new folder is complete).
        progress: report progress on stderr.

    Returns:
        The path of the finished folder.

    Raises:
        GGUFError: unreadable/truncated file, unsupported architecture or tokenizer, bad options.
    """
    src, out_dir = Path(src), Path(out_dir)
    log = _logger(progress)
    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if quantize and q_bits not in Q_BITS:
        raise GGUFError(f"q_bits must be one of {Q_BITS}, not {q_bits}")
    if quantize and q_group_size not in Q_GROUPS:
        raise GGUFError(f"q_group_size must be one of {Q_GROUPS}, not {q_group_size}")
    refuse_existing(out_dir, force, GGUFError)

    start = time.perf_counter()
    log(f"reading {src}")
    reader, md = _open(src)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    try:
        config = build_config(md, shapes, _rope_freqs(reader))
        check_vocabulary(md)
    except (ArchError, TokenizerError) as e:
        raise GGUFError(f"{src}: {e}") from e
    config["eos_token_id"] = eos_token_ids(md)
    if (bos := md.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    # The embedding may have more rows than the token list (padding), never fewer: an id past
    # its rows would read memory outside the matrix.
    n_tokens = len(md.get("tokenizer.ggml.tokens", ())) or config["vocab_size"]
    if n_tokens > config["vocab_size"]:
        raise GGUFError(f"{src}: its tokenizer has {n_tokens} tokens but token_embd.weight only "
                        f"{config['vocab_size']} rows; the file is damaged or not a complete model")
    bad = [i for i in [config.get("bos_token_id"), *config["eos_token_id"]] if i is not None and not 0 <= i < n_tokens]
    if bad:
        raise GGUFError(f"{src}: its metadata names special token id(s) {bad} outside its {n_tokens}-token vocabulary")

    with staging_dir(out_dir, force, GGUFError) as tmp:
        try:
            save_tokenizer(md, tmp)
            # The vocabulary is saved; free it before the weights take the memory.
            md = {k: v for k, v in md.items() if not k.startswith("tokenizer.ggml.")}
            weights = _load_weights(reader, md["general.architecture"], config, dtype, log)
        except (ArchError, TokenizerError) as e:
            raise GGUFError(f"{src}: {e}") from e
        del reader  # drop the memory map before the output is written
        _save_model(tmp, config, weights, quantize, q_bits, q_group_size, log)
    log(f"wrote {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


def _logger(enabled: bool):
    def log(message: str) -> None:
        if enabled:
            print(message, file=sys.stderr, flush=True)

    return log


def _open(src: Path) -> tuple[Any, dict[str, Any]]:
    """`(GGUFReader, metadata)`, or GGUFError if the file is missing, not GGUF or truncated."""
    import gguf

    if not src.is_file():
        raise GGUFError(f"{src}: no such file")
    try:
        reader = gguf.GGUFReader(src, "r")
        # Walking the fields and the tensor table can fail on a file cut short or overwritten.
        md = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, struct.error...
        raise GGUFError(f"{src} is not a readable GGUF file (corrupt or truncated?): {e}") from e
    # md now holds the metadata as Python values. The reader's own copy (numpy views per vocab
    # string) costs about 0.5 GB for a 262k vocabulary and is not needed for the tensors.
    reader.fields.clear()
    size = src.stat().st_size
    if end > size:
        raise GGUFError(f"{src} is truncated: its tensors need {end} bytes, the file has {size}")
    if "general.architecture" not in md:
        raise GGUFError(f"{src} has no general.architecture in its metadata")
    return reader, md


def _rope_freqs(reader: Any) -> Any:
    """The `rope_freqs` tensor (Llama 3.1+ rope scaling) as float32, if the file has one."""
    from gguf.quants import dequantize

    found = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    return dequantize(found[0].data, found[0].tensor_type).reshape(-1) if found else None


def _load_weights(reader: Any, arch: str, config: dict, dtype: str, log) -> dict[str, Any]:
    """Dequantize tensor by tensor into `{hf_name: mx.array}` of `dtype`."""
    import mlx.core as mx
    import numpy as np
    from gguf.quants import dequantize

    target = getattr(mx, dtype)
    weights = {}
    total = len(reader.tensors)
    log(f"dequantizing {total} tensors ({arch}) to {dtype}")
    for i, t in enumerate(reader.tensors):
        if (name := hf_name(t.name, arch)) is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            w = dequantize(t.data, t.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise GGUFError(f"tensor {t.name}: {e}") from e
        try:
            w = to_hf(t.name, w.astype(np.float32, copy=False), arch, config)
        except ValueError as e:  # a reshape the metadata's sizes do not fit
            raise GGUFError(f"tensor {t.name} {shape} does not fit the file's metadata: {e}") from e
        arr = mx.array(w).astype(target)
        mx.eval(arr)  # materialize now, so the float32 copy is freed before the next tensor
        weights[name] = arr
        if (i + 1) * 10 // total != i * 10 // total:
            log(f"  {i + 1}/{total} tensors")
    return weights


def _save_model(
    tmp: Path, config: dict, weights: dict, quantize: bool, bits: int, group: int, log
) -> None:
    """Build mlx-lm's model for `config`, load `weights` strictly, optionally quantize, save."""
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import quantize_model, save_config, save_model

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = model.sanitize(weights)  # e.g. gemma3_text drops lm_head when tied
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GGUFError(f"the tensors do not fit mlx-lm's {config['model_type']} model: {e}") from e
    del weights
    if quantize:
        log(f"quantizing to {bits} bits, group size {group}")
        # quantize_model prints a summary on stdout, which belongs to the command's result.
        with contextlib.redirect_stdout(sys.stderr):
            model, config = quantize_model(model, config, group, bits)
        mx.eval(model.parameters())
    log("saving")
    save_model(tmp, model, donate_model=True)
    save_config(config, tmp / "config.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC.gguf", help="the GGUF file to convert")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the MLX model folder to create")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)"
    )
    parser.add_argument(
        "-q", "--quantize", action="store_true", help="quantize with MLX's affine quantization"
    )
    parser.add_argument(
        "--q-bits", type=int, choices=(4, 8), default=4, help="bits per weight (default 4)"
    )
    parser.add_argument(
        "--q-group-size", type=int, default=64, help="quantization group size (default 64)"
    )
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")


def exit_on_sigterm() -> None:
    """Make a kill (SIGTERM) unwind like Ctrl-C, so work folders are removed on the way out."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    try:
        path = convert(
            args.src,
            args.out_dir,
            dtype=args.dtype,
            quantize=args.quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            force=args.force,
        )
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
