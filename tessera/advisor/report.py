"""The report of `tessera advise --report`: the decisions, then each stage's figures as tables;
with matplotlib installed (the `plots` extra), PNG plots beside it. A .html path gets the same
report as one self-contained HTML page (the `markdown` package, also in the plots extra), its
plots inlined, so it opens anywhere offline."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from tessera.advisor.advise import Advice
from tessera.advisor.profile import Profile


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def _histogram(values: list[int], bins: int = 8) -> list[list]:
    lo, hi = min(values), max(values)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts: dict[int, int] = {}
    for v in values:
        counts[(v - lo) // width] = counts.get((v - lo) // width, 0) + 1
    return [[f"{lo + i * width}-{lo + (i + 1) * width - 1}", counts.get(i, 0), "#" * round(40 * counts.get(i, 0) / len(values))]
            for i in range(-(-(hi - lo + 1) // width))]


def render_report(profile: Profile, advice: Advice, plots_dir: Path | None = None) -> str:
    p = profile
    lines = [f"# Workload report: {p.num_requests} requests on {p.model}", ""]
    lines += ["## Decisions", ""]
    lines += _table(["stage", "decision", "figure", "threshold", "expected gain"],
                    [[d.stage, d.decision, d.figure, d.threshold, d.expected_gain] for d in advice.decisions])
    lines += ["Configuration written (for `tessera serve --config`):", "", "```json",
              json.dumps(advice.config, indent=2), "```", ""]
    lines += [f"- {n}" for n in advice.notes] + [""]

    m = p.memory
    lines += ["## 1. Memory", ""]
    lines += _table(["quantization", "weights (MiB)", "KV tokens that fit"],
                    [[mode, f"{m.weight_bytes[mode] / 2**20:.1f}", f"{m.kv_tokens_fit[mode]:,}"] for mode in m.weight_bytes])
    lines += _table(["KV bytes/token", "peak concurrency", "p90 concurrency", "mean (Little)", "peak KV tokens"],
                    [[m.kv_bytes_per_token, m.peak_concurrency, f"{m.p90_concurrency:.0f}", f"{m.mean_concurrency:.1f}",
                      f"{m.peak_kv_tokens:,}"]])

    x = p.prefix
    lines += ["## 2. Prefix structure", "", f"Hit rate {x.hit_rate:.1%} by tokens ({x.hit_tokens:,} of "
              f"{x.query_tokens:,}); {x.requests_with_hits:.0%} of requests hit. Hit rate by pool size:", ""]
    lines += _table(["pool tokens", "hit rate"], [[f"{t:,}", f"{r:.1%}"] for t, r in x.hit_rate_curve])

    h = p.heterogeneity
    lines += ["## 3. Heterogeneity", ""]
    lines += _table(["", "mean", "p50", "p90", "p99", "max", "CV"],
                    [[name, f"{s.mean:.0f}", f"{s.p50:.0f}", f"{s.p90:.0f}", f"{s.p99:.0f}", s.max, f"{s.cv:.2f}"]
                     for name, s in (("prompt tokens", h.prompt_len), ("output tokens", h.output_len))])
    lines += [f"Static batching (batches of {h.static_batch_size}) would pad {h.static_waste:.1%} of token slots; "
              f"continuous batching {h.continuous_waste:.1%}.", "", "Prompt lengths:", ""]
    lines += _table(["tokens", "requests", ""], _histogram([r.prompt_len for r in p.requests]))
    lines += ["Output lengths:", ""]
    lines += _table(["tokens", "requests", ""], _histogram([r.output_len for r in p.requests]))

    f = p.fragmentation
    lines += ["## 4. Fragmentation", ""]
    lines += _table(["at the simulated peak", "tokens of KV", "unused"],
                    [[f"paged (blocks of {f.block_size})", f"{f.peak_paged_tokens:,}", f"{f.paged_waste:.1%}"],
                     ["contiguous prompt + max_tokens", f"{f.peak_reserved_tokens:,}", f"{f.reserved_waste:.1%}"],
                     [f"contiguous max_model_len ({f.max_model_len})", f"{f.peak_max_len_tokens:,}",
                      f"{1 - f.peak_used_tokens / f.peak_max_len_tokens:.1%}" if f.peak_max_len_tokens else "-"]])

    s = p.speculation
    lines += ["## 5. Latency: speculative decoding", ""]
    if s is None:
        lines += ["The trace has no outputs, so acceptance cannot be estimated.", ""]
    else:
        lines += [f"{s.method}, k={s.num_speculative_tokens}, on {s.requests_with_outputs} requests with known outputs: "
                  f"acceptance {s.acceptance_rate:.1%}, {s.tokens_per_step:.2f} tokens per step, drafts on "
                  f"{s.draft_coverage:.0%} of steps{' (measured)' if s.measured else ' (replayed on the outputs)'}.", ""]
        lines += _table(["batch size", "modelled speedup"], [[b, f"{v:.2f}x"] for b, v in s.speedup_by_batch.items()])

    c = p.scale
    lines += ["## 6. Scale", ""]
    lines += _table(["arrival rate", "peak in 1 s", "inter-arrival CV", "prefill share", "decode share"],
                    [[f"{c.arrival_rate:.2f}/s", f"{c.peak_rate_1s:.0f}", f"{c.interarrival_cv:.2f}",
                      f"{c.prefill_share:.0%}", f"{c.decode_share:.0%}"]])
    lines += _table([f"simulated goodput (req/s meeting TTFT {c.slo_ttft_ms:.0f} ms, ITL {c.slo_itl_ms:.0f} ms)",
                     "req/s"],
                    [["one engine", f"{c.goodput_one_engine:.2f}"], ["two engines", f"{c.goodput_two_colocated:.2f}"],
                     ["one prefill + one decode worker", f"{c.goodput_disaggregated:.2f}"]])
    if plots_dir is not None:
        names = write_plots(p, plots_dir)
        lines += ["## Plots", ""] + [f"![{n}]({plots_dir.name}/{n})" for n in names] + [""]
    return "\n".join(lines)


def write_plots(profile: Profile, out_dir: Path) -> list[str]:
    """Length histograms, the hit-rate curve and simulated KV use; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from tessera.advisor.sim import simulate

    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    axes[0].hist([r.prompt_len for r in profile.requests], bins=20)
    axes[0].set_title("prompt tokens")
    axes[1].hist([r.output_len for r in profile.requests], bins=20)
    axes[1].set_title("output tokens")
    fig.tight_layout()
    fig.savefig(out_dir / "lengths.png")
    names.append("lengths.png")
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot([t for t, _ in profile.prefix.hit_rate_curve], [r for _, r in profile.prefix.hit_rate_curve], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("KV pool (tokens)")
    ax.set_ylabel("prefix hit rate")
    fig.tight_layout()
    fig.savefig(out_dir / "hit_rate.png")
    names.append("hit_rate.png")
    e = profile.engine
    sim = simulate(profile.requests, profile.costs, e["max_num_batched_tokens"], e["max_num_seqs"],
                   kv_capacity_tokens=e["kv_pool_tokens"], block_size=e["block_size"])
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([r.time for r in sim.timeline], [r.paged_tokens for r in sim.timeline], label="paged")
    ax.plot([r.time for r in sim.timeline], [r.reserved_tokens for r in sim.timeline], label="contiguous reservation")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "kv_usage.png")
    names.append("kv_usage.png")
    plt.close("all")
    return names


_HTML_STYLE = """body{font-family:system-ui,sans-serif;max-width:64rem;margin:2rem auto;padding:0 1rem;color:#1d2430}
table{border-collapse:collapse;margin:0.5rem 0 1rem}th,td{border:1px solid #d0d5dd;padding:0.25rem 0.6rem;text-align:left}
th{background:#f2f4f7}pre{background:#f6f7f9;padding:0.75rem;overflow:auto}img{max-width:100%}"""


def markdown_to_html(text: str, base_dir: Path, title: str = "Tessera workload report") -> str:
    """One HTML page of the markdown report, each image it links read from `base_dir` and inlined."""
    try:
        import markdown
    except ImportError as exc:
        raise SystemExit("an HTML --report needs the markdown package: pip install 'tessera[plots]' "
                         "(or give a .md path)") from exc
    body = markdown.markdown(text, extensions=["tables", "fenced_code"])

    def inline(match: re.Match) -> str:
        path = base_dir / html.unescape(match.group(1))
        if not path.is_file():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"'

    body = re.sub(r'src="([^"]+\.png)"', inline, body)
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_HTML_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")
