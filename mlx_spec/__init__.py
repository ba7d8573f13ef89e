"""mlx-spec: lossless speculative decoding with MLX.

    import mlx_spec
    model, tokenizer = mlx_spec.load("path/or/hf-repo")
    text = mlx_spec.generate(model, tokenizer, "Hello", mlx_spec.NGramDrafter())

Names are imported on first use, so `import mlx_spec` (and the CLI's --help)
stays instant and does not load MLX.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "calibrate": ".calibration",
    "CacheRollbackError": ".cache",
    "make_cache": ".cache",
    "InUseError": ".identity",
    "PromptCacheStore": ".prompt_cache",
    "save_prompt_cache": ".prompt_cache",
    "Draft": ".drafters",
    "Drafter": ".drafters",
    "DraftModelDrafter": ".drafters",
    "MixedDrafter": ".drafters",
    "NGramDrafter": ".drafters",
    "Response": ".decode",
    "generate": ".decode",
    "batch_generate": ".decode",
    "BatchResult": ".decode",
    "BatchDecoder": ".batch",
    "stream_generate": ".decode",
    "load_drafter": ".heads",
    "ModelLoadError": ".load_errors",
    "Sampling": ".sampling",
    "SpecStats": ".stats",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'mlx_spec' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


def load(path_or_repo: "str | os.PathLike", lazy: bool = False):
    """Load an mlx-lm model folder or Hugging Face repo: returns (model, tokenizer).

    A model type mlx-lm lacks but `mlx_spec.targets.TARGETS` lists (DeepSeek-V4-Flash,
    `deepseek_v4`) loads through that entry's implementation, installed as an extra.
    Raises `ModelLoadError` (a ValueError and an OSError) naming the missing or damaged
    file and how to replace it, when the folder or repo cannot be loaded. `lazy`: the
    weights are read when first evaluated (`mlx_spec.distributed` keeps only a rank's part).
    """
    from pathlib import Path

    from mlx_lm import load as _load

    from .load_errors import ModelFileNotFoundError, explained
    from .targets import config_of, loader_for

    path_or_repo = os.fspath(path_or_repo)  # a pathlib.Path works as well as a string
    path = Path(path_or_repo).expanduser()
    looks_like_repo = path_or_repo.count("/") == 1 and not path_or_repo.startswith((".", "/", "~"))
    if not path.exists() and not looks_like_repo:
        raise ModelFileNotFoundError(
            path_or_repo, "is neither a folder nor a Hugging Face repo id ('org/name')",
            "give a model folder (with config.json), a repo id, or (on the command line) a zoo name: "
            + ", ".join(_zoo_names()),
        )
    with explained(path_or_repo, "model"):
        if not path.exists():
            from mlx_lm.utils import _download

            path = Path(_download(path_or_repo))
        config = config_of(path)
        target = loader_for(config)
        if target is not None:
            return target(path, config, lazy=lazy)
        return _load(str(path), lazy=lazy)


__all__ = ["load", *_EXPORTS]


def _zoo_names() -> list[str]:
    from .zoo import MODELS

    return list(MODELS)
