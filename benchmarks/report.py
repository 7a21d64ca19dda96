"""Turning results into the printed tables, the design targets (PASS/MISS),
the JSON file and the plot.

A result is a plain dict (it goes to JSON as is):
  {"label", "key", "kind", "series", "n", "dtype", "case": {fields},
   "flops", "competitors": {name: stats dict + "gflops"},
   "skipped": {name: reason}, "disagreements": {name: relative error}}
"""
import json

import cases

MIB = 2**20
TIME_UNIT = {"decode": ("us", 1e6), "tiny": ("us", 1e6)}      # default: ms
TABLE_TITLES = {
    "softmax": "softmax attention, 8 heads (ms)",
    "window": "window attention, window=(256, 0), causal, 8 heads (ms)",
    "linear": "causal linear attention, elu features, chunked, 8 heads (ms)",
    "decode": "decoding: one token per call, state carried (us per call)",
    "tiny": "per-call overhead: a tiny call beside an empty Python call (us per call)",
}


# ------------------------------------------------------------ numbers

def format_value(value):
    if value >= 100:
        return "%.0f" % value
    if value >= 10:
        return "%.1f" % value
    if value >= 1:
        return "%.2f" % value
    return "%.3f" % value


def in_unit(result, seconds):
    return seconds * TIME_UNIT.get(result["kind"], ("ms", 1e3))[1]


def median(result, name):
    stats = result["competitors"].get(name)
    return stats["median_s"] if stats else None


def gemm_gflops(results):
    """{dtype: GFLOP/s of the 2048^3 gemm} from the gemm results."""
    return {r["dtype"]: r["competitors"]["numpy-openblas"]["gflops"]
            for r in results if r["kind"] == "gemm"}


def gemm_rate(result, ceilings):
    """GFLOP/s of the gemm timed in the same rounds as the case, else of the
    run's separate gemm measurement."""
    same_rounds = result["competitors"].get("gemm")
    return same_rounds["gflops"] if same_rounds else ceilings.get(result["dtype"])


def percent_of_gemm(result, ceilings, name="attnx"):
    stats = result["competitors"].get(name)
    ceiling = gemm_rate(result, ceilings)
    if not stats or not stats.get("gflops") or not ceiling:
        return None
    return 100 * stats["gflops"] / ceiling


# ------------------------------------------------------------ tables

def format_table(headers, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).rjust(w) if i else str(cell).ljust(w)
                       for i, (cell, w) in enumerate(zip(line, widths)))
             for line in [headers] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def peer_cell(result, name):
    if name in result["skipped"]:
        return "error" if result["skipped"][name].startswith("raised") else "skip"
    peer, ours = median(result, name), median(result, "attnx")
    if peer is None:
        return "-"
    cell = format_value(in_unit(result, peer))
    return cell + (" (%.2fx)" % (peer / ours) if ours else "")


def attnx_cells(result, ceilings):
    """[median, IQR, GFLOP/s, % of gemm] of attnx ("-" when not measured)."""
    stats = result["competitors"].get("attnx")
    if not stats:
        return ["-", "-", "-", "-"]
    gflops, percent = stats.get("gflops"), percent_of_gemm(result, ceilings)
    return [format_value(in_unit(result, stats["median_s"])),
            "%.1f%%" % (100 * (stats["q3_s"] - stats["q1_s"]) / stats["median_s"]),
            format_value(gflops) if gflops else "-",
            "%.0f%%" % percent if percent is not None else "-"]


def peak_cell(result, name):
    """the fastest call of `name` as a share of the machine's multiply-add
    peak (run.py measures it), "-" where not measured"""
    fraction = (result["competitors"].get(name) or {}).get("peak_fraction")
    return "%.0f%%" % (100 * fraction) if fraction is not None else "-"


def kind_table(results, kind, ceilings):
    group = [r for r in results if r["kind"] == kind]
    if not group:
        return None
    peer_names = cases.COMPETITORS[kind][1:]
    with_flops = kind in cases.FLOP_KINDS
    # the peak share of attnx and of torch's fused attention where it competes
    peak_names = ["attnx"] + [name for name in peer_names if name == "torch-sdpa"]
    headers = ["case", "attnx", "IQR"] + ["%s (ratio)" % name for name in peer_names]
    headers += (["GFLOP/s", "%gemm"] + ["%%peak %s" % name for name in peak_names]
                if with_flops else [])
    rows = []
    for result in group:
        ours = attnx_cells(result, ceilings)
        peers = [peer_cell(result, name) for name in peer_names]
        rows.append([result["label"]] + ours[:2] + peers +
                    (ours[2:] + [peak_cell(result, name) for name in peak_names]
                     if with_flops else []))
    return format_table(headers, rows)


def skip_notes(results):
    sizes = {}
    for result in results:
        for name, reason in result["skipped"].items():
            sizes.setdefault((result["kind"], name, reason), set()).add(result["n"])
    return ["  %s: %s at n = %s: %s" % (kind, name, ", ".join(map(str, sorted(ns))), reason)
            for (kind, name, reason), ns in sizes.items()]


def tables(results):
    ceilings = gemm_gflops(results)
    parts = []
    for kind, title in TABLE_TITLES.items():
        table = kind_table(results, kind, ceilings)
        if table:
            parts += ["", title, table]
    notes = skip_notes(results)
    if notes:
        parts += ["", "skipped:"] + notes
    return "\n".join(parts)


def legend(ceilings):
    gemm = ", ".join("%s %.1f GFLOP/s" % (dtype, rate) for dtype, rate in sorted(ceilings.items()))
    return "\n".join([
        "columns: attnx = median time; IQR = interquartile range of the rounds / median;",
        "  peer (ratio) = peer median and peer/attnx (> 1: attnx faster), medians of the same run;",
        "  GFLOP/s = attnx rate on the counted FLOPs; %gemm = that rate / the rate of numpy's",
        "  OpenBLAS gemm 2048^3 of the same dtype timed in the same rounds (separately, at the",
        "  start and end of the run: " + (gemm or "not measured") + ");",
        "  %peak = the fastest call's rate / the machine's multiply-add peak of its dtype",
        "  (benchmarks/machine_peak.c, measured at the start of the run).",
        "FLOPs counted: softmax %s;" % cases.FLOP_FORMULAS["softmax"],
        "  linear %s (c = %d)." % (cases.FLOP_FORMULAS["linear"], cases.LINEAR_CHUNK),
        "memory: peak resident set during the call minus the resident set before it.",
    ])


def memory_table(probes):
    if not probes:
        return ""
    rows = []
    for probe in probes:
        if "extra_bytes" in probe:
            rows.append([probe["case"], probe["impl"], "%.1f" % (probe["extra_bytes"] / MIB),
                         "%.1f" % (probe["output_bytes"] / MIB), "via " + probe["method"]])
        else:
            rows.append([probe["case"], probe["impl"], "-", "-",
                         probe.get("skipped") or "error: " + probe["error"]])
    return "\n".join(["", "peak extra memory of one call (MiB; fresh process each)",
                      format_table(["case", "impl", "extra", "of it output", "note"], rows)])


# ------------------------------------------------------------ targets

def status_line(passed, text):
    return ("PASS " if passed else "MISS ") + text


def skip_line(text, why):
    return "SKIP %s: %s" % (text, why)


def worst(items):
    """items: (value, label); the smallest value and its label."""
    return min(items) if items else None


def softmax_rate_target(results, ceilings):
    text = "softmax >= 70% of sgemm FLOP rate at n >= 2048, d = 64, float32"
    items = [(percent_of_gemm(r, ceilings), r["label"]) for r in results
             if r["kind"] == "softmax" and r["dtype"] == "float32" and r["case"]["d"] == 64
             and r["n"] >= 2048 and percent_of_gemm(r, ceilings) is not None]
    if not items:
        return skip_line(text, "no such case measured")
    value, label = worst(items)
    return status_line(value >= 70, "%s: worst %.1f%% (%s)" % (text, value, label))


def ratio_items(results, kinds, peer_names, dtype=None):
    """(fastest peer median / attnx median, label) per case (of one dtype)."""
    items = []
    for result in results:
        peers = [median(result, name) for name in peer_names if median(result, name)]
        if dtype is not None and result["dtype"] != dtype:
            continue
        if result["kind"] in kinds and peers and median(result, "attnx"):
            items.append((min(peers) / median(result, "attnx"), result["label"]))
    return items


def speedup_target(results, kinds, peer_names, factor, text, dtype=None):
    items = ratio_items(results, kinds, peer_names, dtype)
    if not items:
        return skip_line(text, "no such case measured")
    value, label = worst(items)
    return status_line(value >= factor, "%s: worst %.2fx (%s)" % (text, value, label))


def speedup_info(results, kinds, peer_names, dtype, text):
    """The same ratio where the issue sets no target (float64): reported only."""
    items = ratio_items(results, kinds, peer_names, dtype)
    if not items:
        return None
    low, high = worst(items), max(items)
    return "INFO %s: %.2fx (%s) to %.2fx (%s)" % (text, low[0], low[1], high[0], high[1])


def kernel_series(results, kind):
    """"attnx-out" (out= given) where the run measured it, else "attnx": the
    targets on scaling and rate are about the kernel, not about the page
    faults of a fresh output (both are printed)."""
    names = {name for r in results if r["kind"] == kind for name in r["competitors"]}
    return "attnx-out" if "attnx-out" in names else "attnx"


def linear_rate_target(results, ceilings):
    text = "causal linear chunk >= 50% of sgemm FLOP rate at n >= 8192"
    name = kernel_series(results, "linear")
    items = [(percent_of_gemm(r, ceilings, name), r["label"]) for r in results
             if r["kind"] == "linear" and r["n"] >= 8192
             and percent_of_gemm(r, ceilings, name) is not None]
    if not items:
        return skip_line(text, "no such case measured")
    value, label = worst(items)
    fresh = worst([(percent_of_gemm(r, ceilings), r["label"]) for r in results
                   if r["kind"] == "linear" and r["n"] >= 8192
                   and percent_of_gemm(r, ceilings) is not None])
    detail = "%s: worst %.1f%% (%s, %s)" % (text, value, label, name)
    if name != "attnx" and fresh:
        detail += "; fresh output: worst %.1f%%" % fresh[0]
    return status_line(value >= 50, detail)


def attnx_by_n(results, kind, name="attnx"):
    return {r["n"]: r for r in results if r["kind"] == kind and median(r, name)}


def time_ratio(results, kind, name, small_n=None, large_n=None):
    """(time at the largest n / time at the smallest, the two results)."""
    by_n = attnx_by_n(results, kind, name)
    if len(by_n) < 2:
        return None
    small, large = by_n[small_n or min(by_n)], by_n[large_n or max(by_n)]
    return median(large, name) / median(small, name), small, large


def linear_scaling_target(results):
    text = "linear chunk time(n=65536) / time(n=8192) <= 8.5"
    name = kernel_series(results, "linear")
    by_n = attnx_by_n(results, "linear", name)
    if 65536 not in by_n or 8192 not in by_n:
        return skip_line(text, "needs both sizes (full run)")
    ratio = time_ratio(results, "linear", name, 8192, 65536)[0]
    detail = "%s: %.2f (%s)" % (text, ratio, name)
    fresh = time_ratio(results, "linear", "attnx", 8192, 65536) if name != "attnx" else None
    if fresh:
        detail += "; fresh output: %.2f" % fresh[0]
    return status_line(ratio <= 8.5, detail)


def window_scaling_target(results):
    text = "window attention linear in n (time ratio <= 1.0625 x FLOP ratio, largest/smallest n)"
    name = kernel_series(results, "window")
    found = time_ratio(results, "window", name)
    if not found:
        return skip_line(text, "needs two sizes (full run)")
    ratio, small, large = found
    flop_ratio = large["flops"] / small["flops"]
    detail = "%s: n=%d/n=%d time x%.2f, FLOPs x%.2f (%s)" % (
        text, large["n"], small["n"], ratio, flop_ratio, name)
    fresh = time_ratio(results, "window", "attnx") if name != "attnx" else None
    if fresh:
        detail += "; fresh output: time x%.2f" % fresh[0]
    return status_line(ratio <= 1.0625 * flop_ratio, detail)


def per_call_us(results, kind, name):
    for result in results:
        if result["kind"] == kind and median(result, name):
            return median(result, name) * 1e6
    return None


def decode_target(results):
    text = "decode step (32 heads, d = 64, state carried) < 10 us"
    steps = {name: per_call_us(results, "decode", name) for name in ("attnx", "attnx-step")}
    steps = {name: us for name, us in steps.items() if us is not None}
    if not steps:
        return skip_line(text, "not measured")
    detail = ", ".join("%s %.2f us" % (name, us) for name, us in steps.items())
    return status_line(min(steps.values()) < 10, "%s: %s" % (text, detail))


def overhead_target(results):
    text = "tiny call (n=m=4, d=8) within 5 us of an empty Python call"
    ours, empty = per_call_us(results, "tiny", "attnx"), per_call_us(results, "tiny", "empty-call")
    if ours is None or empty is None:
        return skip_line(text, "not measured")
    return status_line(ours - empty <= 5, "%s: %.2f us vs %.2f us" % (text, ours, empty))


def memory_growth_target(probes, kind, text):
    """Extra memory, output excluded, at the largest n <= 1.5 x at the
    smallest n + 16 MiB (growth with n*m, or n for chunk, would be far more)."""
    measured = sorted((p["n"], p["extra_bytes"] - p["output_bytes"]) for p in probes
                      if p["impl"] == "attnx" and p["case"].startswith(kind) and "extra_bytes" in p)
    if len(measured) < 2:
        return skip_line(text, "needs two sizes")
    (n_small, small), (n_large, large) = measured[0], measured[-1]
    passed = large <= 1.5 * max(small, 0) + 16 * MIB
    return status_line(passed, "%s: %.1f MiB at n=%d, %.1f MiB at n=%d (output excluded)" % (
        text, small / MIB, n_small, large / MIB, n_large))


def targets(results, probes):
    """The design targets (issue 4: float32, 2 threads), one line each."""
    ceilings = gemm_gflops(results)
    torch_linear = [n for n in cases.COMPETITORS["linear"] if n.startswith("torch")]
    lines = [
        softmax_rate_target(results, ceilings),
        speedup_target(results, ("softmax", "window"), ["torch-sdpa"], 1.2,
                       "softmax >= 1.2x faster than torch SDPA at every float32 shape", "float32"),
        speedup_info(results, ("softmax",), ["torch-sdpa"], "float64",
                     "softmax float64 (no target) against torch SDPA"),
        speedup_target(results, ("linear",), torch_linear, 3.0,
                       "causal linear chunk >= 3x faster than the fastest pure-torch formulation"),
        linear_rate_target(results, ceilings),
        linear_scaling_target(results),
        window_scaling_target(results),
        decode_target(results),
        overhead_target(results),
        memory_growth_target(probes, "softmax", "softmax extra memory independent of n*m"),
        memory_growth_target(probes, "linear", "linear chunk extra memory independent of n"),
    ]
    return [line for line in lines if line is not None]


# ------------------------------------------------------------ files

def write_json(path, machine, results, probes, target_lines):
    with open(path, "w") as f:
        json.dump({"machine": machine, "results": results, "memory": probes,
                   "targets": target_lines, "flop_formulas": cases.FLOP_FORMULAS,
                   "linear_flop_chunk": cases.LINEAR_CHUNK}, f, indent=1)


def plot(path, results, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(r["series"] for r in results if r["series"]))
    if not series:
        return False
    ceilings = gemm_gflops(results)
    columns = 2 if len(series) > 1 else 1
    rows = -(-len(series) // columns)
    fig, axes = plt.subplots(rows, 2 * columns, figsize=(7 * columns * 1.6, 3.2 * rows), squeeze=False)
    for index, name in enumerate(series):
        row, col = divmod(index, columns)
        members = sorted((r for r in results if r["series"] == name), key=lambda r: r["n"])
        plot_series(axes[row][2 * col], axes[row][2 * col + 1], name, members, ceilings)
    for ax in axes.flat[2 * len(series):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def competitor_color(name):
    """One colour per competitor in every panel; attnx black."""
    if name == "attnx":
        return "black"
    known = [n for kind in cases.COMPETITORS.values() for n in kind if n != "attnx"]
    known = list(dict.fromkeys(known))
    return "C%d" % (known.index(name) % 10 if name in known else 9)


def plot_competitor(time_ax, rate_ax, competitor, points):
    """points: [(n, stats dict)] of one competitor along one series."""
    style = dict(linewidth=2.5, marker="o", zorder=3) if competitor == "attnx" else \
        dict(linewidth=1.2, marker=".", alpha=0.85)
    style["color"] = competitor_color(competitor)
    ns = [n for n, _ in points]
    medians_ms = [s["median_s"] * 1e3 for _, s in points]
    spread = [[(s["median_s"] - s["q1_s"]) * 1e3 for _, s in points],
              [(s["q3_s"] - s["median_s"]) * 1e3 for _, s in points]]
    time_ax.errorbar(ns, medians_ms, yerr=spread, label=competitor, capsize=2, **style)
    rate_ax.plot(ns, [s.get("gflops") or float("nan") for _, s in points], label=competitor, **style)


def plot_series(time_ax, rate_ax, name, members, ceilings):
    names = list(dict.fromkeys(c for r in members for c in r["competitors"] if c != "gemm"))
    for competitor in names:
        plot_competitor(time_ax, rate_ax, competitor,
                        [(r["n"], r["competitors"][competitor]) for r in members
                         if competitor in r["competitors"]])
    rate_ax.plot([r["n"] for r in members], [gemm_rate(r, ceilings) or float("nan") for r in members],
                 color="grey", linestyle="--", linewidth=1, marker="x",
                 label="gemm %d^3, same rounds" % cases.GEMM_N)
    for ax, ylabel in ((time_ax, "time per call (ms)"), (rate_ax, "GFLOP/s (counted FLOPs)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    time_ax.set_yscale("log")
    rate_ax.set_ylim(bottom=0)
    rate_ax.legend(fontsize=6, loc="best")
