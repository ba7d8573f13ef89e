"""The report: markdown tables for the terminal, a JSON file, and a PNG chart.

The JSON holds everything (config, hardware, the cost curve, every run's
record, the summary and the targets) so tables and chart can be rebuilt from
it later (`mlx-spec bench --load results.json`). matplotlib is optional: without
it the chart is skipped with a note saying how to get it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .summary import ALL

CHART_HINT = "`pip install matplotlib`, or `pip install -e '.[bench]'` in a checkout"


def _f(x, fmt: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _x(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def _sp(m: dict) -> str:
    s, lo_hi = m.get("speedup"), m.get("speedup_spread")
    if s is None:
        return "–"
    return f"{s:.2f}x" + (f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi else "")


def _positions(p: list[float], n: int = 6) -> str:
    return " ".join(f"{x:.2f}" for x in p[:n]) + (" …" if len(p) > n else "") if p else "–"


def _identical(entry: dict | None, greedy: bool) -> str:
    if not greedy:
        return "n/a (sampling)"
    if entry is None:
        return "–"
    return f"{entry['identical']}/{entry['runs']}" + ("" if entry["identical"] == entry["runs"] else " ✗")


def markdown(result: dict) -> str:
    """All tables of a result, as markdown."""
    summary, suites = result["summary"], result["config"]["suites"]
    greedy = result["config"]["temp"] == 0
    lines = [f"**Hardware:** {result['hardware_line']}", ""]
    lines += [f"> warning: {w}" for w in result["hardware"].get("warnings", [])]
    lines += ["### Speed-up over mlx-lm's plain decoding (median [min–max] of paired runs)", "",
              "| method | " + " | ".join([*suites, ALL]) + " |",
              "|---|" + "---:|" * (len(suites) + 1)]
    for label, per in summary.items():
        lines.append(f"| {label} | " + " | ".join(_sp(per.get(s, {})) for s in [*suites, ALL]) + " |")
    lines += ["", "### Per method and suite", "",
              "| suite | method | decode tok/s | speed-up | whole request | tau | acceptance | "
              "accepted by position | prompt tok/s | peak GB | identical |",
              "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for s in [*suites, ALL]:
        for label, per in summary.items():
            m = per.get(s)
            if m is None:
                continue
            ident = result["identical"].get(label) if s == ALL else None
            lines.append(
                f"| {s} | {label} | {_f(m['decode_tps'])} | {_sp(m)} | {_x(m.get('e2e_speedup'))} | "
                f"{_f(m['tau'])} | "
                f"{_f(m['acceptance_rate'], '.1%')} | {_positions(m['accepted_per_position'])} | "
                f"{_f(m['prompt_tps'], '.1f')} | {_f(m['peak_memory_gb'])} | "
                f"{_identical(ident, greedy) if s == ALL else ''} |")
    lines += _cost_lines(result.get("verify_cost"))
    lines += _head_to_head_lines(result.get("head_to_head"), suites)
    lines += _target_lines(result.get("targets", []))
    if result.get("skipped"):
        lines += ["", "Not run: " + "; ".join(result["skipped"])]
    return "\n".join(lines)


def _cost_lines(cost: dict | None) -> list[str]:
    if not cost:
        return []
    rel = cost["relative"]
    return ["", f"### Verify cost T(n)/T(1) of the target ({cost['context']} tokens in the cache, "
            f"T(1) = {cost['seconds'][0] * 1000:.0f} ms)", "",
            "| n | " + " | ".join(str(i + 1) for i in range(len(rel))) + " |",
            "|---|" + "---:|" * len(rel),
            "| T(n)/T(1) | " + " | ".join(f"{x:.2f}" for x in rel) + " |"]


def _head_to_head_lines(h2h: list[dict] | None, suites: list[str]) -> list[str]:
    if not h2h:
        return []
    out = ["", "### Head to head (a's decode speed over b's on the same prompt and round: median "
           "[90% bootstrap interval]; whole request in the last column)", "",
           "| a vs b | " + " | ".join([*suites, ALL]) + " | whole request |",
           "|---|" + "---:|" * (len(suites) + 2)]
    for h in h2h:
        cells = []
        for s in [*suites, ALL]:
            c = h["suites"].get(s)
            cells.append("–" if c is None else
                         f"{c['ratio']:.2f}x [{c['interval'][0]:.2f}–{c['interval'][1]:.2f}]")
        whole = (h["suites"].get(ALL) or {}).get("e2e_ratio")
        out.append(f"| {h['a']} vs {h['b']} | " + " | ".join(cells) + f" | {_x(whole)} |")
    return out


def _target_lines(targets: list[dict]) -> list[str]:
    if not targets:
        return []
    out = ["", "### Targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for t in targets:
        v = t["value"]
        shown = f"{v:.3f}x" if isinstance(v, float) else str(v)  # (1.145x is not 1.15x)
        out.append(f"| {t['name']} | {t['target']} | {shown} ({t['detail']}) | "
                   f"{'yes' if t['met'] else 'NO'} |")
    return out


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def chart(result: dict, path: Path) -> str | None:
    """Draw the PNG; returns None on success, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"chart skipped: matplotlib is not installed ({CHART_HINT})"
    summary, suites = result["summary"], [*result["config"]["suites"], ALL]
    methods = [m for m in summary if m != result["config"]["baseline"]]
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}  # same colour in every panel
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    ax = axes[0]
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        ys = [(summary[m].get(s) or {}).get("speedup") or 0 for s in suites]
        ax.bar([i + j * width for i in range(len(suites))], ys, width, label=m, color=colors[m])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(suites))], suites)
    ax.set_ylabel("decode speed-up over mlx-lm baseline")
    ax.set_title("Speed-up per method and suite (median)")
    ax.legend(fontsize=8, ncol=2)
    ax = axes[1]
    for m in methods:
        p = summary[m][ALL]["accepted_per_position"]
        if p:
            ax.plot(range(1, len(p) + 1), p, marker="o", label=m, color=colors[m])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction accepted")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per draft position (all suites)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[2]
    cost = result.get("verify_cost")
    if cost:
        n = list(range(1, len(cost["relative"]) + 1))
        ax.plot(n, cost["relative"], marker="o", label="measured T(n)/T(1)")
        ax.plot(n, n, ls="--", color="grey", label="n (no batching gain)")
        ax.set_ylim(0, max(cost["relative"]) * 1.3)
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens per verify forward (n)")
    ax.set_ylabel("time relative to n = 1")
    ax.set_title("Verify cost curve of the target")
    fig.suptitle(f"{result['config']['model_name']}: {result['hardware_line']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
