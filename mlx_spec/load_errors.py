"""Why a model or head folder did not load, in one line: the file at fault and the fix.

`mlx_spec.load` and `mlx_spec.load_drafter` load inside `explained(source, role)`. When
loading fails, the folder is checked file by file (config.json parses, every safetensors
file is as long as its header says, the files the index lists exist, a tokenizer is there)
and the failure becomes a `ModelLoadError` naming the first damaged file and the command
that replaces it: `mlx-spec fetch-model NAME --force` for a zoo folder, `hf download` for
a Hugging Face download, `mlx-spec convert head` for a converted head. Failures that are
not about the files (a head made for another target, a bad option) pass through unchanged.

This module imports nothing heavy: the CLI imports it to catch `ModelLoadError`.
"""

from __future__ import annotations

import json
import re
import struct
from contextlib import contextmanager
from pathlib import Path

ZOO_MARKER = ".mlx-spec-complete.json"  # mlx_spec.zoo.MARKER (not imported: zoo is heavier)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TOKENIZER_MODULES = ("mlx_lm.tokenizer_utils", "transformers", "tokenizers")
_WEIGHTS_MISFIT = re.compile(r"Missing \d+ parameters|parameters not in model|Expected shape")
_MAX_DETAIL = 240


class ModelLoadError(ValueError, OSError):
    """A model, draft model or head folder cannot be loaded.

    `path` is the file (or folder, or repo id) at fault, `problem` what is wrong with it
    and `fix` the step that repairs it. It is a ValueError and an OSError, as the
    failures it replaces were (bad JSON, missing files, weights that do not fit).
    """

    def __init__(self, path, problem: str, fix: str):
        self.path, self.problem, self.fix = path, _one_line(problem), fix
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.path} {self.problem}; {self.fix}"


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A file the folder needs is not there (also a FileNotFoundError, as before)."""


@contextmanager
def explained(source, role: str = "model"):
    """Turn a failed load of `source` (a folder or a Hugging Face repo id) into a
    ModelLoadError; `role` is "model" (target or draft model) or "head" (load_drafter)."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:
        error = explain(e, source, role)
        if error is None:
            raise
        raise error from e


def explain(error: BaseException, source, role: str = "model") -> ModelLoadError | None:
    """The ModelLoadError that says why loading `source` failed with `error`, or None when
    the failure is not about the folder's files."""
    if Path(source).expanduser().is_file():
        return ModelLoadError(
            source, "is a file, not a model folder",
            "give the folder that holds config.json (convert a GGUF file first: "
            "`mlx-spec convert gguf FILE.gguf OUT_DIR`)",
        )
    folder = local_folder(source)
    text = _one_line(str(error)) or type(error).__name__
    if folder is None:  # a repo id that is not downloaded, and the download failed
        if isinstance(error, OSError) or type(error).__module__.startswith("huggingface_hub"):
            return ModelLoadError(
                source, f"cannot be downloaded from Hugging Face ({_short(text)})",
                f"check the repo id and the network, or download it first: `hf download {source}`",
            )
        return None
    fix = fix_for(folder, role)
    found = diagnose(folder, role)
    if found is not None:
        path, problem = found
        cls = ModelFileNotFoundError if problem.startswith("is missing") else ModelLoadError
        return cls(path, problem, fix)
    if isinstance(error, ValueError) and _WEIGHTS_MISFIT.search(text):
        weights = _weight_files(folder)
        where = weights[0] if len(weights) == 1 else folder / "model*.safetensors"
        return ModelLoadError(where, f"does not fit config.json ({_short(text)})", fix)
    model_type = re.search(r"Model type (\S+) not supported", text)
    if model_type:
        return ModelLoadError(
            folder / "config.json", f"names model_type {model_type.group(1)!r}, which the "
            "installed mlx-lm does not support",
            fix if _zoo_entry(folder) else "upgrade mlx-lm (`pip install -U mlx-lm`) or fix it",
        )
    if role == "model" and _raised_in(error, TOKENIZER_MODULES):
        where = folder / "tokenizer.json"
        return ModelLoadError(where, f"does not load as a tokenizer ({_short(text)})", fix)
    if isinstance(error, (OSError, KeyError)) or "load_safetensors" in text:
        return ModelLoadError(folder, f"cannot be loaded ({_short(text)})", fix)
    return None


def local_folder(source) -> Path | None:
    """`source` as a local folder: itself, or its Hugging Face cache snapshot; else None."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(str(source), "config.json")
    except Exception:  # no hub client, or not a valid repo id
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def diagnose(folder: Path, role: str = "model") -> tuple[Path, str] | None:
    """The first missing or damaged file of `folder` and what is wrong with it, or None."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config, problem = _read_json(config_path)
    if problem is not None:
        return config_path, problem
    if not isinstance(config, dict):
        return config_path, "does not hold a JSON object"
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index, problem = _read_json(index_path)
        if problem is not None:
            return index_path, problem
        listed = (index or {}).get("weight_map", {}) if isinstance(index, dict) else {}
        for name in sorted(set(listed.values())):
            if not (folder / name).is_file():
                return folder / name, f"is missing ({index_path.name} lists it)"
    weights = _weight_files(folder)
    if not weights and (role == "model" or "mlx_spec" in config):
        return folder / "model.safetensors", "is missing (the folder has no model*.safetensors)"
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            return path, problem
    if role == "model":
        if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(
            folder.glob("*.tiktoken")
        ):
            return folder / "tokenizer.json", "is missing (the folder has no tokenizer file)"
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                _, problem = _read_json(folder / name)
                if problem is not None:
                    return folder / name, problem
    return None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing (header and length), or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: not even a header)"
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            return f"is damaged or truncated (its header claims {n:,} bytes, the file has {size:,})"
        try:
            header = json.loads(f.read(n))
            ends = [
                int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"
            ]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has a damaged header (not a safetensors tensor table)"
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"is truncated ({size:,} of {need:,} bytes)"
    return None


def fix_for(folder: Path, role: str = "model") -> str:
    """The step that replaces `folder`'s files, from where the folder came from."""
    folder = Path(folder)
    zoo = _zoo_entry(folder)
    if zoo is not None:
        name, dtype, root = zoo
        cmd = f"mlx-spec fetch-model {name} --force"
        cmd += f" --dtype {dtype}" if dtype != "float32" else ""
        if folder.parent.name != "models" or folder.name != f"{name}-{dtype}":  # a copy
            return f"it is a copy of a zoo model: `{cmd}` fetches it again and prints its folder"
        cmd += f" --cache-dir {root}" if root != _default_zoo_root() else ""
        return f"fetch it again: `{cmd}`"
    hub = re.search(r"models--([^/\\]+)--([^/\\]+)[/\\]snapshots", str(folder.resolve()))
    if hub:
        return f"download it again: `hf download {hub.group(1)}/{hub.group(2)} --force-download`"
    config, _ = _read_json(folder / "config.json")
    if (isinstance(config, dict) and "mlx_spec" in config) or (role == "head" and config is None):
        cmd = f"mlx-spec convert head SRC {folder} --target TARGET --force"
        return f"convert the head again: `{cmd}`"
    gguf = sorted(folder.glob("*.gguf"))
    if gguf:
        return f"convert the GGUF again (`mlx-spec convert gguf {gguf[0]} OUT_DIR`), use OUT_DIR"
    return (
        "replace the folder: download the model again "
        f"(`hf download ORG/NAME --local-dir {folder}`) or convert it again "
        "(`mlx_lm.convert --hf-path ORG/NAME --mlx-path NEW_DIR`)"
    )


def _zoo_entry(folder: Path) -> tuple[str, str, Path] | None:
    marker, _ = _read_json(folder / ZOO_MARKER)
    if isinstance(marker, dict) and isinstance(marker.get("name"), str):
        return marker["name"], str(marker.get("dtype", "float32")), folder.parent.parent
    return None


def _default_zoo_root() -> Path:
    from .zoo import default_cache_dir

    return default_cache_dir()


def _weight_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("model*.safetensors"))


def _read_json(path: Path):
    """(value, None), or (None, what is wrong with the file)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, "is missing"
    except UnicodeDecodeError:
        return None, "is not text (damaged)"
    except ValueError as e:
        return None, f"is not valid JSON ({e})"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"


def _raised_in(error: BaseException, modules: tuple[str, ...]) -> bool:
    tb = error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name.split(".")[0] in modules or name in modules:
            return True
        tb = tb.tb_next
    return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _short(text: str) -> str:
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 1] + "…"
