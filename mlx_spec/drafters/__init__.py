"""Drafters: everything that proposes tokens for the target to verify."""

from .base import EMPTY, Draft, Drafter
from .draft_model import DraftModelDrafter
from .mixed import MixedDrafter
from .ngram import NGramDrafter

# CLI names -> drafter classes that need no files.
DRAFTERS = {"ngram": NGramDrafter}

__all__ = ["Draft", "Drafter", "DraftModelDrafter", "MixedDrafter", "NGramDrafter", "DRAFTERS", "EMPTY"]
