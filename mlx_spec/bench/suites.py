"""Prompt suites (data/suites/*.json) and turning a prompt into the target's token ids.

Each suite is one kind of work with a different amount of copying, which is
what decides how much a drafter can guess: code editing repeats the prompt
(prompt lookup's best case), open chat repeats almost nothing (its worst).
The prompts were written for this project. Every method gets the same token
ids: the chat template is applied once, here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUITES_DIR = Path(__file__).parent / "data" / "suites"
SUITE_ORDER = ("code-gen", "code-edit", "chat", "json", "math")


@dataclass(frozen=True)
class Prompt:
    suite: str
    id: str
    text: str


def suite_names() -> list[str]:
    """Known suites: the standard five first, then any extra files."""
    found = sorted(p.stem for p in SUITES_DIR.glob("*.json"))
    return [s for s in SUITE_ORDER if s in found] + [s for s in found if s not in SUITE_ORDER]


def load_suite(name: str) -> list[Prompt]:
    path = SUITES_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(suite_names())}")
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Prompt(name, p["id"], p["prompt"]) for p in data["prompts"]]


def load_prompts(names: list[str], per_suite: int | None = None) -> list[Prompt]:
    """The first `per_suite` prompts of each named suite, suite by suite."""
    out: list[Prompt] = []
    for name in names:
        prompts = load_suite(name)
        out += prompts[:per_suite] if per_suite else prompts
    return out


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn, with the assistant turn opened.

    Tokenizers without a chat template (base models, test tokenizers) get the
    plain text.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already holds any BOS token; don't add a second one.
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))
