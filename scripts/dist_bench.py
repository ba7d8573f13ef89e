"""A sharded target against the same target on one process: same text? how fast?

    mlx.launch -n 2 --backend ring -- python scripts/dist_bench.py --shard pipeline
    MLX_SPEC_LINK_LATENCY_MS=5 mlx.launch -n 2 --backend ring -- python scripts/dist_bench.py

Every rank decodes the same prompts with the sharded target, plain and with an
n-gram drafter; rank 0 also decodes them with the whole (unsharded) target
(the other ranks wait meanwhile) and prints, per method: tokens/s, target
forwards, ms per step, and for the sharded runs the part of a step that is not
the target's arithmetic (sharded ms per forward minus unsharded ms per forward
of the same width: messages, waiting for the other ranks, simulated latency),
plus the first position where the sharded greedy text differs, if any, and the
median time of one all_sum of a draft proposal and of a hidden state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPTS = [  # prompts whose answers repeat their input (n-gram drafting finds matches)
    "Repeat this sentence exactly, three times: The quick brown fox jumps over the lazy dog.",
    "Rewrite this Python function with type hints, keeping everything else:\n"
    "def area(width, height):\n    return width * height\n",
    "List the numbers from 1 to 20, separated by commas.",
]


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shard", default="pipeline", choices=("pipeline", "tensor"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", default="4", help="draft length (or auto)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    p.add_argument("--make-gpu-like", metavar="FOLDER", default=None,
                   help="(no launch) write a 30-layer width-64 random llama with SmolLM2's "
                   "tokenizer to FOLDER: arithmetic negligible, so messages dominate a step")
    args = p.parse_args()
    if args.make_gpu_like:
        return make_gpu_like(args.make_gpu_like, args.model)
    k = args.k if args.k == "auto" else int(args.k)

    import mlx.core as mx

    import mlx_spec
    from mlx_spec import distributed
    from mlx_spec.generate_cli import encode_prompt, resolve_model

    path = resolve_model(args.model)
    group = distributed.init()
    rank0 = group.rank() == 0
    model, tok = distributed.load(path, args.shard, group)
    layout = distributed.describe(model)
    prompts = [encode_prompt(tok, t, None, True) for t in PROMPTS]
    whole = mlx_spec.load(path)[0] if rank0 else None

    def decode(target, drafter):
        tic = time.perf_counter()
        out = list(mlx_spec.stream_generate(target, tok, ids, drafter, max_tokens=args.max_tokens,
                                            num_draft_tokens=k if drafter else 1))
        s = out[-1].stats
        return [r.token for r in out], s, time.perf_counter() - tic

    def message_ms(shape, dtype=mx.float32, repeats=40) -> float:
        """Median ms of one all_sum of `shape` (every rank at once), simulated latency included."""
        x = mx.zeros(shape, dtype)
        mx.eval(x)
        times = []
        for _ in range(repeats):
            tic = time.perf_counter()
            model._mlx_spec_shard.stats.message()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(1000 * (time.perf_counter() - tic))
        return round(statistics.median(times), 3)

    width = model.args.hidden_size
    messages = {"draft proposal (4 ints)": message_ms((4,), mx.int32),
                "hidden state, 1 token": message_ms((1, 1, width)),
                "hidden state, 5 tokens": message_ms((1, 5, width))}
    runs = {}
    for _ in range(args.rounds):
        for i, ids in enumerate(prompts):
            for name, drafter in (("plain", None), ("ngram", mlx_spec.NGramDrafter())):
                for where, target in (("sharded", model), ("whole", whole)):
                    if target is None:
                        continue
                    tokens, s, _ = decode(target, drafter)
                    r = runs.setdefault((where, name, i), {"tokens": tokens, "tps": [], "ms": []})
                    r["tps"].append(s.generation_tps)
                    r["ms"].append(1000 * s.step_seconds / max(s.target_forwards, 1))
                    r["forwards"], r["verified"] = s.target_forwards, s.step_tokens  # (not the prompt pass's token)
            mx.clear_cache()
    if not rank0:
        return 0
    rows = []
    for name in ("plain", "ngram"):
        for where in ("whole", "sharded"):
            rs = [runs[(where, name, i)] for i in range(len(prompts))]
            tps = statistics.mean(statistics.median(r["tps"]) for r in rs)
            ms = statistics.mean(statistics.median(r["ms"]) for r in rs)
            tau = sum(r["verified"] for r in rs) / max(sum(r["forwards"] for r in rs), 1)
            rows.append({"method": name, "target": where, "tok_s": round(tps, 1),
                         "ms_per_step": round(ms, 2), "tokens_per_forward": round(tau, 2)})
        whole_ms, sharded_ms = rows[-2]["ms_per_step"], rows[-1]["ms_per_step"]
        rows[-1]["not_compute_ms"] = round(sharded_ms - whole_ms, 2)
    diverge = {}
    for i in range(len(prompts)):
        a, b = runs[("whole", "plain", i)]["tokens"], runs[("sharded", "plain", i)]["tokens"]
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        diverge[i] = "same" if first is None and len(a) == len(b) else f"differs at token {first}"
    import os

    result = {"layout": layout, "shard": args.shard, "k": args.k, "max_tokens": args.max_tokens,
              "latency_ms": float(os.environ.get(distributed.LATENCY_ENV, "0") or 0),
              "rows": rows, "greedy_text_vs_whole": diverge, "all_sum_ms": messages}
    print(layout)
    print("one all_sum, median ms:", messages)
    print(f"simulated link latency per message: {result['latency_ms']} ms")
    print("| method | target | tok/s | ms/step | tokens/forward | not compute, ms/step |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['target']} | {r['tok_s']} | {r['ms_per_step']} | "
              f"{r['tokens_per_forward']} | {r.get('not_compute_ms', '')} |")
    print("greedy text, sharded vs whole:", diverge)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def make_gpu_like(folder: str, like: str) -> int:
    import dataclasses
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from transformers import AutoTokenizer

    from mlx_spec.generate_cli import resolve_model

    source = resolve_model(like)
    tok = AutoTokenizer.from_pretrained(source)
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=30,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=len(tok), tie_word_embeddings=True)
    model = llama.Model(args)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tok.save_pretrained(str(out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
