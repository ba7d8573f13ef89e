"""`mlx-spec serve` against in-process `stream_generate`: decode speed, time to first token,
and a second chat turn served from the prompt cache.

    python scripts/server_bench.py [--model smollm2-135m-instruct] [--draft ngram | --draft-model NAME]
        [--num-draft-tokens 4] [--max-tokens 64] [--runs 3] [--ttft-runs 15]

One process loads the model once, starts the server on 127.0.0.1 (a free port) in a thread,
and alternates runs: in-process `stream_generate` (its own drafter object, built the same
way) and a streamed chat completion read over HTTP, both cold (the server's prompt cache is
emptied before each of its runs). Decode speed is (tokens - 1) / (last token - first token)
on each side, over the tokens that carry text; time to first token is from the call (in-process) or from sending the request
(server) to the first token's text. Medians of --runs runs after one warm-up run each; the added time to first token is also
measured on a short prompt (--ttft-runs interleaved pairs), where prefill noise is small.
Then a two-turn conversation: the second turn's time to first token from the cache, and the
same request against an emptied cache (a cold prefill of the whole conversation).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time

PROMPTS = {  # what each model is asked: text a drafter can help with
    "default": "Copy this list exactly, one item per line: apples, pears, plums, cherries, figs, "
               "grapes, lemons, limes, melons, peaches, apricots, mangoes, kiwis, dates.",
    "coder": "Rename the variable `total` to `acc` in this function and return the whole "
             "function:\n\ndef add_all(values):\n    total = 0\n    for v in values:\n"
             "        total += v\n    if total < 0:\n        total = 0\n    return total\n",
}
CONTEXT = ("The river starts in the hills, runs past the old mill, under the stone bridge and "
           "through the town, where the market is held on Saturdays. ") * 24


def main() -> int:
    from mlx_spec.fastblas import restart_with_fast_blas

    restart_with_fast_blas()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", default=None, help="ngram (default), none, mtp, dspark or a head folder")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-draft-tokens", default="4")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ttft-runs", type=int, default=15)
    args = p.parse_args()
    k = args.num_draft_tokens if args.num_draft_tokens == "auto" else int(args.num_draft_tokens)

    import mlx_spec
    from mlx_spec.generate_cli import make_drafter, resolve_model
    from mlx_spec.server.app import Server, create_app
    from mlx_spec.server.engine import Engine

    path = resolve_model(args.model)
    model, tok = mlx_spec.load(path)
    ns = argparse.Namespace(draft=args.draft, draft_model=args.draft_model)
    engine = Engine(model, tok, make_drafter(ns, model, path), model_id="bench", num_draft_tokens=k).start()
    local = make_drafter(ns, model, path)
    server = Server(create_app(engine), engine, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    text = PROMPTS["coder" if "coder" in args.model else "default"]
    messages = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    print(f"model {args.model}, drafter {engine.drafter_kind or 'none'}, k={k}, prompt {len(ids)} "
          f"tokens, max_tokens {args.max_tokens}, {args.runs} runs (+1 warm-up) each, interleaved")

    rows = {"in-process": [], "server": []}
    texts = {}
    for run in range(args.runs + 1):
        tic, times, out = time.perf_counter(), [], ""
        for r in mlx_spec.stream_generate(model, tok, ids, local, max_tokens=args.max_tokens,
                                          num_draft_tokens=k):
            if r.text:  # as the server sends a chunk only for a token with text
                times.append(time.perf_counter())
            out += r.text
        texts["in-process"] = out
        if run:
            rows["in-process"].append(_figures(tic, times))
        engine.store.clear()
        tic, times, out = _stream(server.port, messages, args.max_tokens, k)
        texts["server"] = out
        if run:
            rows["server"].append(_figures(tic, times))
    print(f"same text both ways: {texts['in-process'] == texts['server']}")
    print(f"{'':12s} {'decode tok/s':>13s} {'TTFT ms':>9s} {'tokens':>7s}")
    med = {}
    for name, figs in rows.items():
        med[name] = [statistics.median(f[i] for f in figs) for i in range(3)]
        print(f"{name:12s} {med[name][0]:13.2f} {med[name][1]:9.1f} {med[name][2]:7.0f}")
    print(f"server / in-process decode: {med['server'][0] / med['in-process'][0]:.1%}; "
          f"time to first token {med['server'][1] - med['in-process'][1]:+.1f} ms")

    # Time to first token on a short prompt, where prefill noise is small: many interleaved pairs.
    short = [{"role": "user", "content": "Say hello."}]
    short_ids = tok.apply_chat_template(short, add_generation_prompt=True)
    diffs, outside = [], []
    for run in range(args.ttft_runs + 1):
        tic = time.perf_counter()
        for r in mlx_spec.stream_generate(model, tok, short_ids, local, max_tokens=4, num_draft_tokens=k):
            if r.text:
                inproc = time.perf_counter() - tic
                inproc_prefill = r.prompt_tokens / r.prompt_tps
                break
        engine.store.clear()
        tic, times, _, usage = _stream(server.port, short, 4, k, usage=True)
        if run:
            diffs.append(1000 * (times[0] - tic - inproc))
            # the same, less each side's own prefill time (the part that varies with load)
            outside.append(1000 * ((times[0] - tic - usage["timings"]["prompt_ms"] / 1000)
                                   - (inproc - inproc_prefill)))
    print(f"added time to first token ({len(short_ids)}-token prompt, median of {args.ttft_runs} "
          f"interleaved pairs): {statistics.median(diffs):+.1f} ms; outside the prefill: "
          f"{statistics.median(outside):+.1f} ms")

    # A second turn: from the cache, then against an emptied cache.
    first = [{"role": "user", "content": CONTEXT + "\nWhere is the market held?"}]
    engine.store.clear()
    _, _, reply = _stream(server.port, first, 32, k)
    turn2 = first + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "And what does the river pass first?"}]
    warm = _stream(server.port, turn2, 8, k, usage=True)
    engine.store.clear()
    cold = _stream(server.port, turn2, 8, k, usage=True)
    print(f"second turn ({cold[3]['prompt_tokens']} prompt tokens): time to first token "
          f"{1000 * (warm[1][0] - warm[0]):.0f} ms from the cache ({warm[3]['prompt_tokens_details']['cached_tokens']} "
          f"cached) vs {1000 * (cold[1][0] - cold[0]):.0f} ms cold; same text: {warm[2] == cold[2]}")
    server.should_exit = True
    thread.join(20)
    engine.close()
    return 0


def _figures(tic: float, times: list[float]) -> tuple[float, float, int]:
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return decode, 1000 * (times[0] - tic), len(times)


def _stream(port: int, messages, max_tokens: int, k, usage: bool = False):
    """(start, [time of each token's chunk], text[, usage]) of a streamed greedy chat completion."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "num_draft_tokens": k, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    tic = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    resp, times, text, last = conn.getresponse(), [], "", None
    while True:
        line = resp.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                text += chunk["choices"][0]["delta"]["content"]
            elif chunk.get("usage"):
                last = {**chunk["usage"], "timings": chunk["timings"]}
    conn.close()
    return (tic, times, text, last) if usage else (tic, times, text)


if __name__ == "__main__":
    sys.exit(main())
