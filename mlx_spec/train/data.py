"""Training data by self-distillation, and the draft vocabulary built from it.

The head learns what the target says, so the target writes its own data (as
EAGLE-3 and HASS train on target-generated answers): each prompt is rendered
with the target's chat template and answered greedily by the target through
mlx-spec's batched decode loop (`batch_generate`). Prompts come from a JSONL
file (rows with `messages`, a chat list, or `prompt`, a string) or, without
one, from the target itself: its chat template's user-turn header is given
to the target, which writes a user turn (Magpie, arXiv 2406.08464), sampled
with a seed. No data set is downloaded.

Files in the output folder (JSONL, one row per sample, written atomically):
* `data.jsonl`   {"tokens": [...], "prompt_len": n}: prompt and answer ids;
* `eval.jsonl`   {"messages": [...]}: held-out prompts, never trained on.
`--resume` reads both back instead of generating again.

Draft vocabulary (EAGLE-3 / SpecForge): the `V_d` ids most frequent among the
answer tokens (ties: lower id first; ids never seen fill up the rest in id
order), sorted; `d2t` maps draft id i to target id `d2t[i]`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

_SENTINEL = "\x00MLXSPEC\x00"
BATCH = 16  # rows decoded together while generating (16: ~1.5x the tokens/s of 8 on a 2-core CPU)


class DataError(ValueError):
    """Unusable training input: the message names the problem and the fix."""


def read_prompts(path) -> list[list[dict]]:
    """Chat message lists from a JSONL file of `{"messages": [...]}` or `{"prompt": "..."}` rows."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--prompts {path}: no such file")
    out, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        msgs = _messages(row)
        if msgs is None:
            bad += 1
        else:
            out.append(msgs)
    if out and bad:
        logging.getLogger("mlx_spec").warning("--prompts %s: %d of %d rows skipped (not JSON, or without a "
                                              "non-empty 'messages' list or 'prompt' string)", path, bad, bad + len(out))
    if not out:
        raise DataError(
            f"--prompts {path}: no usable rows ({bad} unreadable or without a non-empty 'messages' "
            "list or 'prompt' string). Write one JSON object per line, e.g. "
            '{"prompt": "Explain recursion"} or {"messages": [{"role": "user", "content": "Hi"}]}'
        )
    return out


def _messages(row) -> list[dict] | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return [{"role": "user", "content": row["prompt"]}]
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in msgs
    ):
        # Train on the answer to everything up to the last user turn.
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        return msgs or None
    return None


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids: the chat template with the assistant header, or the raw text without one."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


# Magpie's topic control (arXiv 2406.08464, section 2): a system turn before the user header
# steers what kind of request the target writes. None: the template's own default turn.
TOPICS = {
    "chat": None,
    "code": "You are an expert programmer. Users ask you to write, fix or explain code: Python "
            "functions and classes, JavaScript, SQL queries, Rust, shell commands.",
}


def user_header(tokenizer, system: str | None = None) -> list[int]:
    """The ids the chat template puts before a user turn's text (Magpie's prompt), after a
    `system` turn when one is given."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the target's tokenizer has no chat template, so it cannot write its own prompts; "
            "pass --prompts FILE (JSONL rows with 'prompt' or 'messages')"
        )
    turns = [{"role": "system", "content": system}] if system else []
    try:
        text = tokenizer.apply_chat_template(turns + [{"role": "user", "content": _SENTINEL}], tokenize=False)
    except Exception as e:  # templates that refuse a system turn
        raise DataError(f"the chat template refuses a system turn ({e}); use --magpie-topics chat "
                        "or pass --prompts FILE") from e
    head = text.split(_SENTINEL)[0]
    if not head or head == text or (system and system not in head):
        raise DataError("the chat template does not show where a user turn starts; pass --prompts FILE")
    return list(tokenizer.encode(head, add_special_tokens=False))


def magpie_prompts(model, tokenizer, n: int, seed: int, max_tokens: int = 64, log=print,
                   topics=("chat",)) -> list[list[dict]]:
    """`n` user turns written by the target from its chat template's user header (sampled; row i
    of round r uses seed `seed + r * n + i`, so every row draws its own turn). Row i is steered
    to topic `topics[i % len(topics)]` (`TOPICS`); the turns are returned without the system
    turn, so the answers are written in the template's default context."""
    unknown = [t for t in topics if t not in TOPICS]
    if unknown or not topics:
        raise DataError(f"--magpie-topics {','.join(topics)}: choose from {', '.join(TOPICS)}")
    headers = [user_header(tokenizer, TOPICS[t]) for t in topics]
    out: list[list[dict]] = []
    seen: set[str] = set()
    for r in range(4):  # rounds: short or repeated turns are dropped and drawn again
        want = n - len(out)
        if want <= 0:
            break
        seeds = [seed + r * n + i for i in range(want)]
        texts = _sample(model, tokenizer, [headers[(len(out) + i) % len(headers)] for i in range(want)],
                        seeds, max_tokens)
        for text in texts:
            text = text.replace(tokenizer.eos_token or "\x00", "").strip()
            if len(text) >= 8 and text not in seen:
                seen.add(text)
                out.append([{"role": "user", "content": text}])
        log(f"prompts: {len(out)}/{n} written by the target")
    if not out:
        raise DataError("the target wrote no usable prompts from its chat template; pass --prompts FILE")
    return out[:n]


def _sample(model, tokenizer, prompts: list[list[int]], seeds: list[int], max_tokens: int) -> list[str]:
    """One sampled continuation of each prompt (with its seed), decoded together."""
    from ..decode import batch_generate

    return batch_generate(model, tokenizer, prompts, None, max_tokens=max_tokens, max_batch=BATCH,
                          temp=1.0, top_p=0.95, seed=list(seeds)).texts


def answer(model, tokenizer, prompts: list[list[int]], max_length: int, log=print) -> list[dict]:
    """Greedy answers of the target: rows {"tokens", "prompt_len"}, at most `max_length` ids each."""
    from ..decode import batch_generate

    rows = []
    keep = [p for p in prompts if len(p) <= max_length - 8]  # room for an answer of 8 tokens or more
    for s in range(0, len(keep), 2 * BATCH):
        part = keep[s : s + 2 * BATCH]
        budgets = [max_length - len(p) for p in part]  # each row up to max_length, whatever its neighbours
        res = batch_generate(model, tokenizer, part, None, max_batch=BATCH, max_tokens=budgets)
        for p, toks in zip(part, res.tokens):
            if toks:
                rows.append({"tokens": [int(t) for t in p + toks][:max_length], "prompt_len": len(p)})
        log(f"answers: {min(s + 2 * BATCH, len(keep))}/{len(keep)}")
    return rows


def write_jsonl(path: Path, rows: list) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def draft_vocab(rows: list[dict], size: int, vocab: int) -> np.ndarray:
    """Sorted target ids of the draft vocabulary: the `size` most frequent answer tokens."""
    if size > vocab:
        raise DataError(f"--draft-vocab {size} is larger than the target's vocabulary ({vocab}); "
                        f"pass at most {vocab}")
    counts = np.zeros(vocab, np.int64)
    for r in rows:
        ans = np.asarray(r["tokens"][r["prompt_len"]:], np.int64)
        np.add.at(counts, ans[(ans >= 0) & (ans < vocab)], 1)
    order = np.lexsort((np.arange(vocab), -counts))  # by count desc, then id asc
    return np.sort(order[:size]).astype(np.int32)


def coverage(rows: list[dict], ids: np.ndarray) -> float:
    """Share of answer tokens inside the draft vocabulary."""
    inside = set(int(i) for i in ids)
    ans = [t for r in rows for t in r["tokens"][r["prompt_len"]:]]
    return sum(t in inside for t in ans) / max(1, len(ans))
