"""mlx-spec: lossless speculative decoding with MLX.

    import mlx_spec
    model, tokenizer = mlx_spec.load("path/or/hf-repo")
    text = mlx_spec.generate(model, tokenizer, "Hello", mlx_spec.NGramDrafter())
"""

from __future__ import annotations

from .cache import CacheRollbackError, make_cache
from .drafters import Draft, Drafter, DraftModelDrafter, NGramDrafter
from .decode import Response, generate, stream_generate
from .heads import load_drafter
from .sampling import Sampling
from .stats import SpecStats

__version__ = "0.1.0"


def load(path_or_repo: str):
    """Load an mlx-lm model folder or Hugging Face repo: returns (model, tokenizer)."""
    from pathlib import Path

    from mlx_lm import load as _load

    path = Path(path_or_repo).expanduser()
    if not path.exists() and (path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1):
        raise FileNotFoundError(
            f"no model folder at {path_or_repo!r} (and it is not a Hugging Face repo id "
            "like 'org/name')"
        )
    return _load(str(path) if path.exists() else path_or_repo)


__all__ = [
    "CacheRollbackError", "Draft", "Drafter", "DraftModelDrafter", "NGramDrafter",
    "Response", "Sampling", "SpecStats", "generate", "load", "load_drafter", "make_cache", "stream_generate",
]
