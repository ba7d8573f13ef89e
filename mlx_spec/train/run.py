"""The two jobs, end to end: `train_eagle3` (a new head) and `realign` (fine-tune a head).

Both follow the same order, and every check on the user's input runs before
any data is generated or any step is trained: the output folder (new, or a
run to resume), the prompts file, the draft vocabulary size, the taps, and
for `realign` the head itself (made for this target, an EAGLE-3 head with its
own LM head, not quantized). Then: data (generated, or read back on resume),
training, and the evaluation with the real decode loop written to
`DIR/eval.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..drafters.base import check_target, target_output_rows, vocab_size
from ..request import whole
from ..taps import EMBED, decoder_stack, final_norm_name
from . import data as D
from .evaluate import evaluate, summary
from .export import head_config, save_json, target_identity
from .trainer import Settings, Trainer, settings_dict


TOPICS = ("chat", "code")  # what the target's own prompts ask for, alternating (data.TOPICS)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_taps(n_layers: int) -> list:
    """EAGLE-3's low/mid/high taps: inputs of layers 2, N//2, N-3 = outputs of 1, N//2-1, N-4."""
    if n_layers < 5:
        raise ValueError(f"the target has {n_layers} decoder layers; the EAGLE-3 default taps need at "
                         "least 5: pass --tap-layers a,b,c")
    return [1, n_layers // 2 - 1, n_layers - 4]


def check_taps(model, taps) -> list:
    n = len(decoder_stack(model).layers)
    taps = default_taps(n) if not taps else list(taps)
    bad = [t for t in taps if t != EMBED and not (isinstance(t, int) and 0 <= t < n)]
    if bad:
        raise ValueError(f"--tap-layers {bad}: the target has decoder layers 0..{n - 1} (or 'embed')")
    if len(set(taps)) < len(taps):
        raise ValueError(f"--tap-layers {taps}: each layer at most once (EAGLE-3 fuses distinct layers)")
    return taps


def check_numbers(*, samples, eval_prompts, max_length, epochs, steps, lr, ttt_steps, checkpoint_every,
                  log_every, eval_k, eval_tokens, seed=0) -> None:
    """The numeric settings, refused before any work when they cannot run."""
    from ..cache import MAX_DRAFT

    at_least_1 = {"--samples": samples, "--eval-prompts": eval_prompts, "--ttt-steps": ttt_steps,
                  "--checkpoint-every": checkpoint_every, "--log-every": log_every, "--eval-tokens": eval_tokens}
    for flag, value in at_least_1.items():
        if not (whole(value) and value >= 1):
            raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")
    if not (whole(max_length) and max_length >= 16):
        raise ValueError(f"--max-length must be at least 16 tokens, got {max_length!r}")
    if steps is not None and not (whole(steps) and steps >= 1):
        raise ValueError(f"--steps must be a whole number >= 1 (or left out: --epochs decides), got {steps!r}")
    if not epochs > 0:
        raise ValueError(f"--epochs must be more than 0, got {epochs!r}")
    if not lr > 0:
        raise ValueError(f"--lr must be more than 0, got {lr!r}")
    if not (whole(eval_k) and 1 <= eval_k <= MAX_DRAFT):
        raise ValueError(f"--eval-k must be a draft length 1..{MAX_DRAFT}, got {eval_k!r}")
    if not (whole(seed) and 0 <= seed < 2**32):
        raise ValueError(f"--seed must be a whole number 0..{2**32 - 1}, got {seed!r}")


def check_out(out: Path, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder (new, or a run's to --resume)")
    if resume:
        if not (out / "train.json").is_file() or not (out / "state.json").is_file():
            raise ValueError(f"--resume: {out} holds no checkpoint of a training run (train.json, "
                             "state.json; a run stopped while generating its data has none): start "
                             "without --resume in a new or empty folder")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; pass --resume to continue the run in it, "
                         "or choose a new --out")


# Where a run keeps the settings --resume continues with, by flag (the rest shape its data or head).
_SAVED = {"--steps": ("settings", "steps"), "--lr": ("settings", "lr"), "--ttt-steps": ("settings", "ttt_steps"),
          "--seed": ("settings", "seed"), "--checkpoint-every": ("settings", "checkpoint_every"),
          "--log-every": ("settings", "log_every"), "--feature-cache-gb": ("settings", "feature_cache_gb"),
          "--eval-k": ("eval_k",), "--eval-tokens": ("eval_tokens",), "--drafter": ("drafter",), "--init": ("init",)}


def saved_run(out: Path, kind: str) -> dict:
    """The train.json of the `kind` run to resume in `out`."""
    check_out(out, True)
    run = json.loads((out / "train.json").read_text())
    if run.get("kind") != kind:
        raise ValueError(f"{out} holds a train {run.get('kind')} run; resume it with `mlx-spec train "
                         f"{run.get('kind')} --resume`")
    return run


# Settings a resumed run may change: they change neither its data, its schedule nor its weights.
RESUME_MAY_CHANGE = {"--feature-cache-gb": "feature_cache_gb", "--log-every": "log_every",
                     "--checkpoint-every": "checkpoint_every"}


def check_resume(out: Path, kind: str, given: dict) -> None:
    """Refuse flags given with --resume that would not be used: a run continues with its own settings
    (that is what makes a resumed run's weights an uninterrupted one's), but for memory and logging
    (`RESUME_MAY_CHANGE`)."""
    run, wrong = saved_run(out, kind), []
    for flag, value in given.items():
        if flag in RESUME_MAY_CHANGE:
            continue
        if flag == "--epochs":
            wrong.append(f"--epochs {value} (the run is {run['settings']['steps']} optimizer steps long, fixed when it started)")
            continue
        if flag not in _SAVED:
            wrong.append(f"{flag} {value} (fixed when the run made its data and head)")
            continue
        saved = run
        for key in _SAVED[flag]:
            saved = saved.get(key) if isinstance(saved, dict) else None
        if saved != value:
            wrong.append(f"{flag} {value} (the run has {saved})")
    if wrong:
        raise ValueError(f"--resume continues {out} with the settings it was started with, and these differ: "
                         f"{'; '.join(wrong)}. Leave them out, or start a new run in another --out.")


def read_prompts(path, seed: int) -> list:
    """The prompts file's rows in a seeded order (`--samples` takes the first ones)."""
    rows = D.read_prompts(path)
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]


def _messages_for(model, tokenizer, prompts, n: int, seed: int, log, topics) -> list:
    """`n` prompts: the first of a list of chat message lists, a seeded draw from a JSONL file, or
    written by the target itself (None)."""
    if prompts is not None:
        return list(read_prompts(prompts, seed) if isinstance(prompts, (str, Path)) else prompts)[:n]
    return D.magpie_prompts(model, tokenizer, n, seed, log=log, topics=topics)


def make_data(model, tokenizer, out: Path, prompts, samples: int, eval_n: int, max_length: int, seed: int,
              log, topics=TOPICS) -> tuple[list, list]:
    """Generate (training rows, held-out eval prompts) into `out`."""
    msgs, ids = _templated(tokenizer, _messages_for(model, tokenizer, prompts, samples + eval_n, seed, log, topics), log)
    if len(msgs) < 2:
        raise D.DataError(f"{len(msgs)} usable prompt(s); training needs at least 2 (one is held out)")
    if len(msgs) < samples + eval_n:  # fewer prompts than asked for: hold out a fifth at most
        eval_n = min(eval_n, max(1, len(msgs) // 5))
    held = msgs[:eval_n]
    rows = D.answer(model, tokenizer, ids[eval_n:eval_n + samples], max_length, log=log)
    if not rows:
        raise D.DataError(f"no training sequences: every prompt leaves fewer than 8 of --max-length "
                          f"{max_length} tokens for its answer; raise --max-length")
    out.mkdir(parents=True, exist_ok=True)
    D.write_jsonl(out / "data.jsonl", rows)
    D.write_jsonl(out / "eval.jsonl", [{"messages": m} for m in held])
    return rows, held


def _templated(tokenizer, msgs: list, log) -> tuple[list, list]:
    """(the prompts the target's chat template takes, their token ids): some templates raise on,
    e.g., two user turns in a row; those prompts are left out, counted in one warning."""
    ok, ids, refused = [], [], []
    for m in msgs:
        try:
            ids.append(D.encode_chat(tokenizer, m))
            ok.append(m)
        except Exception as e:  # jinja2's TemplateError, or anything the template raises
            refused.append(e)
    if refused:
        log(f"warning: skipped {len(refused)} prompt(s) the chat template refuses "
            f"(first: {type(refused[0]).__name__}: {refused[0]})")
    return ok, ids


def _load_data(out: Path) -> tuple[list, list]:
    return D.read_jsonl(out / "data.jsonl"), [r["messages"] for r in D.read_jsonl(out / "eval.jsonl")]


INITS = ("target", "random")  # how a new head's output layer starts (--init)


def init_from_target(head, model, ids) -> list:
    """Start the head's output layer as the target's own, cut to the draft vocabulary: `lm_head`
    row i = the target's output row for token ids[i], and `norm` = the target's final norm when
    that is a plain RMSNorm (same formula). A head trained on a few thousand sequences then only
    has to learn what to feed that layer, not a vocabulary-sized projection from scratch.
    Returns the names of the parameters set."""
    head.lm_head.weight = target_output_rows(model, ids).astype(head.lm_head.weight.dtype)
    done = ["lm_head"]
    stack = decoder_stack(model)
    name = final_norm_name(stack)
    norm = getattr(stack, name) if name else None
    if type(norm) is type(head.norm) and norm.weight.shape == head.norm.weight.shape:
        head.norm.weight = norm.weight.astype(head.norm.weight.dtype)
        done.append("norm")
    return done


def _steps(steps, epochs, n: int) -> int:
    return int(steps) if steps is not None else max(1, int(round(epochs * n)))


def _finish(trainer: Trainer, model, tokenizer, out: Path, held, eval_k, eval_tokens, on_step, log,
            before=None) -> dict:
    trainer.run(on_step)
    from ..heads import load_drafter

    figures = evaluate(model, tokenizer, load_drafter(out, model), held, eval_k, eval_tokens, log=log)
    report = figures if before is None else {"before": before, "after": figures}
    save_json(out / "eval.json", report)
    if before is not None:
        log("before: " + summary(before))
    log(("after: " if before is not None else "") + summary(figures))
    return report


def train_eagle3(model, tokenizer, out, *, prompts=None, samples: int = 1000, eval_prompts: int = 8,
                 max_length: int = 512, epochs: float = 2, steps: int | None = None,
                 draft_vocab: int | None = None, tap_layers=None, resume: bool = False, seed: int = 0,
                 lr: float = 3e-4, ttt_steps: int = 7, checkpoint_every: int = 200, log_every: int = 10,
                 eval_k: int = 4, eval_tokens: int = 128, data_from=None, topics=TOPICS,
                 feature_cache_gb: float = 2.0, init: str = "target", on_step=None,
                 resume_with: dict | None = None, log=_err) -> dict:
    """Train a new EAGLE-3 head for `model` into `out`; returns the evaluation figures.

    `prompts`: a JSONL path, a list of chat message lists, or None (the target writes them);
    `data_from`: the folder of an earlier run whose data (and held-out prompts) to reuse;
    `init`: "target" starts the head's output layer as the target's (`init_from_target`),
    "random" as a fresh layer; `resume_with`: settings a resumed run changes (`RESUME_MAY_CHANGE`'s,
    by Settings name)."""
    from ..drafters.eagle import Eagle3Head

    out = Path(out)
    check_out(out, resume)
    check_numbers(samples=samples, eval_prompts=eval_prompts, max_length=max_length, epochs=epochs, steps=steps,
                  lr=lr, ttt_steps=ttt_steps, checkpoint_every=checkpoint_every, log_every=log_every,
                  eval_k=eval_k, eval_tokens=eval_tokens, seed=seed)
    if resume:
        run = saved_run(out, "eagle3")
        cfg = json.loads((out / "config.json").read_text())
        check_target(model, f"{out} (the run to resume)", "Resume with the target the run was started with.",
                     made_for=cfg["mlx_spec"]["target"])
        rows, held = _load_data(out)
        settings = Settings(**{**run["settings"], **(resume_with or {})})
        d2t = mx.load(str(out / "model.safetensors"))["draft_to_target"]
        head = Eagle3Head(cfg)
        trainer = Trainer(model, head, cfg, d2t, rows, out, settings, log)
        trainer.restore()
        log(f"resuming {out} at step {trainer.step}/{settings.steps}")
        return _finish(trainer, model, tokenizer, out, held, run["eval_k"], run["eval_tokens"], on_step, log)
    V = vocab_size(model)
    draft_vocab = min(V, 16384) if draft_vocab is None else int(draft_vocab)
    if draft_vocab > V:
        raise D.DataError(f"--draft-vocab {draft_vocab} is larger than the target's vocabulary ({V}); "
                          f"pass at most {V}")
    if draft_vocab < 1:
        raise D.DataError(f"--draft-vocab must be at least 1, got {draft_vocab}")
    if init not in INITS:
        raise ValueError(f"--init {init!r}: choose one of {', '.join(INITS)}")
    taps = check_taps(model, tap_layers)
    if data_from is not None and not (Path(data_from) / "data.jsonl").is_file():
        raise ValueError(f"--data-from {data_from}: no data.jsonl there (the folder of an earlier train run)")
    if data_from is not None:  # another run's generated set, reused as it is
        made = Path(data_from) / "config.json"  # (the head that run made says for which target)
        if made.is_file():
            check_target(model, f"--data-from {data_from}", "Reuse data the same target wrote.",
                         made_for=json.loads(made.read_text())["mlx_spec"]["target"])
        rows, held = _load_data(Path(data_from))
        out.mkdir(parents=True, exist_ok=True)
        D.write_jsonl(out / "data.jsonl", rows)
        D.write_jsonl(out / "eval.jsonl", [{"messages": m} for m in held])
    else:
        if isinstance(prompts, (str, Path)):
            prompts = read_prompts(prompts, seed)  # a bad file fails here, before any model work
        rows, held = make_data(model, tokenizer, out, prompts, samples, eval_prompts, max_length, seed, log,
                               topics)
    ids = D.draft_vocab(rows, draft_vocab, V)
    log(f"{len(rows)} sequences, {sum(len(r['tokens']) for r in rows)} tokens; draft vocabulary {draft_vocab} "
        f"covers {D.coverage(rows, ids):.1%} of answer tokens")
    cfg = head_config(model, taps, draft_vocab)
    mx.random.seed(seed)
    head = Eagle3Head(cfg)
    d2t = mx.array(ids)
    if init == "target":
        log("output layer from the target's: " + ", ".join(init_from_target(head, model, ids)))
    mx.eval(head.parameters())
    settings = Settings(steps=_steps(steps, epochs, len(rows)), lr=lr, ttt_steps=ttt_steps, seed=seed,
                        checkpoint_every=checkpoint_every, log_every=log_every,
                        feature_cache_gb=feature_cache_gb, taps=taps)
    save_json(out / "train.json", {"kind": "eagle3", "init": init, "settings": settings_dict(settings),
                                   "eval_k": eval_k,
                                   "eval_tokens": eval_tokens, "samples": len(rows)})
    trainer = Trainer(model, head, cfg, d2t, rows, out, settings, log)
    trainer.save()  # step 0: the folder is a loadable head (and resumable) from the start
    return _finish(trainer, model, tokenizer, out, held, eval_k, eval_tokens, on_step, log)


def realign(model, tokenizer, drafter_dir, out, *, prompts=None, samples: int = 2000, eval_prompts: int = 8,
            max_length: int = 512, epochs: float = 1, steps: int | None = None, resume: bool = False,
            seed: int = 0, lr: float = 1e-4, ttt_steps: int = 7, checkpoint_every: int = 200,
            log_every: int = 10, eval_k: int = 4, eval_tokens: int = 128, topics=TOPICS,
            feature_cache_gb: float = 2.0, on_step=None, resume_with: dict | None = None, log=_err) -> dict:
    """Fine-tune the EAGLE-3 head in `drafter_dir` to `model`; eval.json holds tau before and after."""
    from ..drafters.eagle import Eagle3Head
    from ..heads import load_drafter

    out = Path(out)
    check_out(out, resume)
    check_numbers(samples=samples, eval_prompts=eval_prompts, max_length=max_length, epochs=epochs, steps=steps,
                  lr=lr, ttt_steps=ttt_steps, checkpoint_every=checkpoint_every, log_every=log_every,
                  eval_k=eval_k, eval_tokens=eval_tokens, seed=seed)
    if resume:
        run = saved_run(out, "realign")
        drafter_dir = run["drafter"]
    drafter = load_drafter(drafter_dir, model)  # refuses a head made for another target
    head, cfg = drafter.head, json.loads(json.dumps(drafter.config))
    if not isinstance(head, Eagle3Head):
        raise ValueError(f"{drafter_dir} is not an EAGLE-3 head; realign fine-tunes EAGLE-3 heads")
    if cfg.get("quantization"):
        raise ValueError(f"{drafter_dir} is quantized; realign a float head (convert it without -q), "
                         "then quantize the result")
    if "lm_head" not in head:
        raise ValueError(f"{drafter_dir} drafts with the target's LM head; realign needs a head with its own")
    V = vocab_size(model)
    d2t = drafter._d2t if drafter._d2t is not None else mx.arange(V, dtype=mx.int32)
    cfg["mlx_spec"]["target"] = target_identity(model)
    # A float32 master copy (exact for bf16/fp16 weights): steps of lr ~1e-4 are below a bfloat16
    # weight's resolution and would round away. The head is written in float32, as train eagle3's.
    cast = any(v.dtype != mx.float32 for _, v in tree_flatten(head.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    if cast:
        head.set_dtype(mx.float32)
        log(f"{drafter_dir} holds lower-precision weights: fine-tuned and written in float32")
    if resume:
        rows, held = _load_data(out)
        settings = Settings(**{**run["settings"], **(resume_with or {})})
        trainer = Trainer(model, head, cfg, d2t, rows, out, settings, log)
        trainer.restore()
        eval_k, eval_tokens = run["eval_k"], run["eval_tokens"]
    else:
        if isinstance(prompts, (str, Path)):
            prompts = read_prompts(prompts, seed)
        rows, held = make_data(model, tokenizer, out, prompts, samples, eval_prompts, max_length, seed, log, topics)
        settings = Settings(steps=_steps(steps, epochs, len(rows)), lr=lr, ttt_steps=ttt_steps, seed=seed,
                            checkpoint_every=checkpoint_every, log_every=log_every,
                            feature_cache_gb=feature_cache_gb, taps=list(drafter.taps))
        run = {"kind": "realign", "drafter": str(Path(drafter_dir).resolve()), "settings": settings_dict(settings),
               "eval_k": eval_k, "eval_tokens": eval_tokens, "samples": len(rows)}
        save_json(out / "train.json", run)
        trainer = Trainer(model, head, cfg, d2t, rows, out, settings, log)
        trainer.save()  # resumable from here: the data and step 0, before the evaluation below
    if "before" not in run:  # the published head on the held-out prompts (again, when stopped in it)
        # As published: restore() or the float32 copy changed `drafter`.
        published = load_drafter(drafter_dir, model) if resume or cast else drafter
        run["before"] = evaluate(model, tokenizer, published, held, eval_k, eval_tokens, log=log)
        log("before: " + summary(run["before"]))
        save_json(out / "train.json", run)
    return _finish(trainer, model, tokenizer, out, held, eval_k, eval_tokens, on_step, log, before=run["before"])
