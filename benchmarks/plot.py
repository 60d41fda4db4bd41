"""Draw the benchmark figure (PNG) from the JSON files the scripts write.

    python benchmarks/throughput.py --json benchmarks/results/throughput_cpu.json
    python benchmarks/memory.py --json benchmarks/results/memory_cpu.json
    python benchmarks/plot.py --throughput benchmarks/results/throughput_cpu.json \
        --memory benchmarks/results/memory_cpu.json --out benchmarks/results/benchmarks_cpu.png

Left: throughput ratio to plain ``keras.Model`` at the same micro-batch
(median of per-round ratios, bars; whiskers: min-max over rounds), per
network and mode. Right: training-attributable peak memory vs N for plain
N*B, ``GradientAccumulationModel`` (B, N) and the built-in optimizer option
(B, N), with plain B and the goal limit as horizontal lines (one panel per
memory measure in the JSON).

``--features`` draws a figure of its own from ``features.py``'s JSON (which
also calls ``plot_features`` for its ``--plot``): per network and mode, the
time ratio of each feature to its counterpart (horizontal bars from 1: median
of per-round ratios; whiskers: min-max), with the A/A control's min-max
shaded:

    python benchmarks/plot.py --features benchmarks/results/features_cpu.json \
        --out benchmarks/results/features_cpu.png
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"plain-aa": "#999999", "ours": "#1f77b4", "ours-nobn": "#9ecae1",
          "builtin": "#ff7f0e", "ours-instep": "#9467bd",
          "plain-large": "#d62728", "plain": "#2ca02c"}
MEMORY_TITLES = {"gpu": "GPU memory (get_memory_info)",
                 "tensors": "TF tensor memory (CPU, BFC)",
                 "rss": "process RSS"}


def short_label(entry):
    kind, n = entry["kind"], entry["n"]
    if kind == "plain-aa":
        return "plain (A/A)"
    if kind == "ours":
        return f"ours N={n}"
    if kind == "builtin":
        return f"built-in N={n}"
    if kind == "ours-nobn":
        return f"ours N={n}, no window BN"
    if kind == "ours-instep":
        return f"ours in-step N={n}"
    return kind


def plot_throughput(ax, data):
    results = [e for e in data["results"] if e["kind"] != "plain"]
    groups = []
    for e in results:
        g = (e["network"], e["mode"])
        if g not in groups:
            groups.append(g)
    x = 0.0
    ticks, ticklabels, group_centers = [], [], []
    for g in groups:
        members = [e for e in results if (e["network"], e["mode"]) == g]
        start = x
        for e in members:
            r = e["ratio_vs_plain"]
            ax.bar(x, r["median"], color=COLORS.get(e["kind"], "k"), width=0.8)
            ax.errorbar(x, r["median"], yerr=[[r["median"] - r["min"]],
                                             [r["max"] - r["median"]]],
                        color="k", capsize=2, lw=0.8)
            ticks.append(x)
            ticklabels.append(short_label(e))
            x += 1
        group_centers.append(((start + x - 1) / 2, f"{g[0]}, {g[1]}"))
        x += 1.0
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(ticks)
    ax.set_xticklabels(ticklabels, rotation=90, fontsize=7)
    lo = min(e["ratio_vs_plain"]["min"] for e in results)
    hi = max(e["ratio_vs_plain"]["max"] for e in results)
    ax.set_ylim(min(0.8, lo - 0.02), max(1.2, hi + 0.02))
    for cx, name in group_centers:
        ax.text(cx, ax.get_ylim()[1], name, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("micro-batches/s relative to plain keras.Model (same B)")
    env = data["environment"]
    ax.set_title(f"Throughput ratio (median, min-max over {data['settings']['rounds']} "
                 f"rounds)\n{env['device']}", fontsize=9, pad=16)


def plot_memory(ax, data, metric):
    settings = data["settings"]
    ns = sorted(set(settings["ns"]) | set(settings.get("in_step_ns", [])))
    rec = {(r["kind"], r["n"]): r for r in data["results"] if "error" not in r}
    MiB = 2.0**20

    def series(kind):
        xs, ys = [], []
        for n in ns:
            if (kind, n) in rec:
                xs.append(n)
                ys.append(rec[(kind, n)]["metrics"][metric]["attributable"] / MiB)
        return xs, ys

    for kind, name in (("plain-large", "plain, batch N*B"),
                       ("ours", "GradientAccumulationModel (B, N)"),
                       ("builtin", "built-in SGD(gradient_accumulation_steps=N)"),
                       ("ours-instep", "GradientAccumulationModel(micro_batch_size=B), "
                                       "batch N*B")):
        xs, ys = series(kind)
        if xs:
            ax.plot(xs, ys, marker="o", color=COLORS[kind], label=name)
    plain_b = rec[("plain", 1)]["metrics"][metric]["attributable"] / MiB
    ax.axhline(plain_b, color=COLORS["plain"], ls="--", label=f"plain, batch B={settings['batch']}")
    limit = data["limit_bytes"][metric] / MiB
    ax.axhline(limit, color="k", ls=":", label="goal limit: 1.05 x (plain B + params)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("N (micro-batches per update)")
    ax.set_ylabel("training-attributable peak (MiB)")
    ax.set_title(f"Peak memory: {MEMORY_TITLES.get(metric, metric)}\nU-Net "
                 f"{settings['size']}x{settings['size']}, B={settings['batch']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


FEATURE_NAMES = {
    "aa": "A/A control", "across": "across steps, N=4",
    "in_step": "in-step, micro_batch_size=B", "auto": "micro_batch_size='auto'",
    "window_bn": "window BatchNorm", "non_finite": "non-finite check (skip)",
    "mixed_float16": "mixed_float16", "backup": "BackupAndRestore",
}


def plot_features(data, out, clock="cpu"):
    """Horizontal bars of ``features.py``'s ratios (B/A time per
    micro-batch), one group per network and mode, the A/A band shaded."""
    results = data["results"]
    groups = []
    for e in results:
        if (e["network"], e["mode"]) not in groups:
            groups.append((e["network"], e["mode"]))
    fig, ax = plt.subplots(figsize=(8, 0.32 * (len(results) + 2 * len(groups)) + 1.5))
    y = 0.0
    ticks, labels, heads, lo, hi = [], [], [], 1.0, 1.0
    for g in groups:
        members = [e for e in results if (e["network"], e["mode"]) == g]
        top = y
        for e in members:
            r = e["ratio"][clock]
            color = COLORS["plain-aa"] if e["row"] == "aa" else COLORS["ours"]
            ax.barh(y, r["median"] - 1.0, left=1.0, height=0.7, color=color)
            ax.errorbar(r["median"], y, xerr=[[r["median"] - r["min"]],
                                              [r["max"] - r["median"]]],
                        color="k", capsize=2, lw=0.8)
            ticks.append(y)
            labels.append(FEATURE_NAMES.get(e["row"], e["row"]))
            lo, hi = min(lo, r["min"]), max(hi, r["max"])
            y += 1
        band = next((e["ratio"][clock] for e in members if e["row"] == "aa"), None)
        if band is not None:
            ax.fill_betweenx([top - 0.5, y - 0.5], band["min"], band["max"],
                             color="0.85", zorder=0)
        heads.append((top - 0.9, f"{g[0]}, {g[1]}"))
        y += 1.5
    pad = 0.05 * max(hi - lo, 0.1)
    ax.set_xlim(lo - pad, hi + pad)
    for head_y, text in heads:
        ax.text(lo - pad, head_y, " " + text, ha="left", va="center",
                fontsize=8, fontweight="bold")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(y - 1.0, -1.5)  # first group on top
    clock_name = "process CPU time" if clock == "cpu" else "wall time"
    ax.set_xlabel(f"time per micro-batch, with the feature / without "
                  f"({clock_name})\n> 1: the feature costs time")
    env = data["environment"]
    ax.set_title(f"Cost per step of each feature (median, min-max over "
                 f"{data['settings']['rounds']} rounds; shaded: A/A band)\n"
                 f"{env['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"Wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--throughput", default=None, help="JSON from throughput.py")
    parser.add_argument("--memory", default=None, help="JSON from memory.py")
    parser.add_argument("--features", default=None,
                        help="JSON from features.py (a figure of its own)")
    parser.add_argument("--out", required=True, help="PNG path")
    args = parser.parse_args(argv)
    if args.features:
        if args.throughput or args.memory:
            parser.error("--features draws a figure of its own: give it alone")
        with open(args.features) as f:
            plot_features(json.load(f), args.out)
        return 0
    panels = []
    if args.throughput:
        with open(args.throughput) as f:
            panels.append(("throughput", json.load(f), None))
    if args.memory:
        with open(args.memory) as f:
            mem = json.load(f)
        for metric in mem["settings"]["metrics"]:
            panels.append(("memory", mem, metric))
    if not panels:
        parser.error("give --throughput and/or --memory, or --features")
    widths = [2.2 if p[0] == "throughput" else 1.0 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * sum(widths), 5.5),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    for ax, (kind, data, metric) in zip(axes[0], panels):
        if kind == "throughput":
            plot_throughput(ax, data)
        else:
            plot_memory(ax, data, metric)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"Wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
