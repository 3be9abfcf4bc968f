#!/usr/bin/env python3
"""Draws one or more training runs from the CSV logs that mpx::fit writes (csv_log).

    scripts/plot_run.py run.mixed_float16.csv run.float32.csv -o run.png
    scripts/plot_run.py log.csv --label "lr 1e-3" -o run.png

One PNG with three panels over the training steps: the loss and the accuracy of each
step (a faint line for the raw values, a bold one smoothed), and the loss scale on a log
axis; skipped steps (a NaN or inf gradient) are red marks. One colour per run. A log of a
run that shadowed its layers (fit_options::shadow_every, fashion_mnist --shadow N) adds a
fourth panel: each layer's error against its float32 twin over the steps (the worst of
its output, input-gradient and weight-gradient errors), one colour per layer. A run's
label is --label, else the CSV's policy column, else a policy named in the file name
(fashion_mnist --csv run writes run.mixed_float16.csv), else the file name.

Exit status: 0 when the PNG was written; 1 for a missing, empty or malformed CSV (the
message names the file and line); 3 when matplotlib is not installed.
"""
import argparse
import csv
import math
import os
import sys

COLUMNS = ("epoch", "step", "loss", "loss_scale", "skipped", "gradient_norm", "accuracy", "seconds")
# The shadow's columns: error/<layer>/<what>, filled on the shadow steps only.
SHADOW_PREFIX = "error/"
SHADOW_MEASURES = ("output", "input_gradient", "weight_gradient")
# Every preset, longest first: a name may contain another (mixed_fp8 in mixed_fp8_block).
POLICIES = ("mixed_fp8_rowwise", "mixed_fp8_current", "mixed_bfloat16", "mixed_fp8_block", "mixed_float16",
            "mixed_mxfp8", "mixed_nvfp4", "mixed_fp8", "bfloat16", "float32")


class LogError(Exception):
    pass


def read_log(path):
    """The rows of one csv_log as a dict of columns (floats), plus the policy if a column names it."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise LogError(f"{path}: the file is empty (expected the header {','.join(COLUMNS)})")
            header = [h.strip() for h in header]
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise LogError(f"{path}: not a csv_log of mpx::fit: no column {', '.join(missing)} "
                               f"(header: {','.join(header)})")
            index = {c: header.index(c) for c in header}
            data = {c: [] for c in COLUMNS}
            shadow_columns = {}  # layer -> the indices of its error columns
            for i, c in enumerate(header):
                if c.startswith(SHADOW_PREFIX) and c.rsplit("/", 1)[-1] in SHADOW_MEASURES:
                    shadow_columns.setdefault(c[len(SHADOW_PREFIX):c.rindex("/")], []).append(i)
            data["shadow"] = {layer: [] for layer in shadow_columns}  # layer -> [(step, worst error)]
            policies = set()
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) != len(header):
                    raise LogError(f"{path}:{line}: {len(row)} fields, the header has {len(header)}")
                for c in COLUMNS:
                    text = row[index[c]].strip()
                    try:
                        data[c].append(float(text))  # "inf" and "nan" are valid: a diverged step
                    except ValueError:
                        raise LogError(f"{path}:{line}: {c} is not a number: '{text}'") from None
                if "policy" in index:
                    policies.add(row[index["policy"]].strip())
                for layer, columns in shadow_columns.items():
                    cells = [row[i].strip() for i in columns if row[i].strip()]
                    if not cells:
                        continue  # not a shadow step, or nothing of this layer was measured
                    try:
                        values = [float(t) for t in cells]
                    except ValueError:
                        raise LogError(f"{path}:{line}: an error of {layer} is not a number: {cells}") from None
                    worst = math.nan if any(math.isnan(v) for v in values) else max(values)
                    data["shadow"][layer].append((len(data["step"]), worst))
    except FileNotFoundError:
        raise LogError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise LogError(f"{path}: cannot read it: {e}") from None
    if not data["step"]:
        raise LogError(f"{path}: no steps after the header (was the run stopped before its first step?)")
    return data, (policies.pop() if len(policies) == 1 else None)


def label_for(path, policy):
    if policy:
        return policy
    name = os.path.basename(path)
    for p in POLICIES:
        if p in name:
            return p
    return os.path.splitext(name)[0]


def smoothed(values, weight):
    """Exponential moving average with the start-up bias removed (TensorBoard's smoothing); skips non-finite values."""
    out, average, total = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            average = weight * average + (1 - weight) * v
            total = weight * total + (1 - weight)
        out.append(average / total if total > 0 else math.nan)
    return out


def plot(runs, output, smooth, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shadowed = any(any(points for points in data["shadow"].values()) for _, data in runs)
    if shadowed:
        fig, (ax_loss, ax_acc, ax_scale, ax_shadow) = plt.subplots(
            4, 1, sharex=True, figsize=(10, 11), gridspec_kw={"height_ratios": [3, 2, 1.6, 2.4]})
    else:
        fig, (ax_loss, ax_acc, ax_scale) = plt.subplots(3, 1, sharex=True, figsize=(10, 8.5),
                                                        gridspec_kw={"height_ratios": [3, 2, 1.6]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]  # runs that agree draw over each other: each stays visible
    any_skipped = False
    for i, (label, data) in enumerate(runs):
        colour, style = colours[i % len(colours)], styles[i % len(styles)]
        steps = list(range(1, len(data["step"]) + 1))  # over every epoch
        weight = smooth if smooth is not None else 1 - 1 / min(100, max(2, len(steps) / 40))
        finite = [v if math.isfinite(v) else math.nan for v in data["loss"]]
        ax_loss.plot(steps, finite, color=colour, alpha=0.15, linewidth=0.7)
        ax_loss.plot(steps, smoothed(data["loss"], weight), color=colour, linestyle=style, linewidth=1.8, label=label)
        ax_acc.plot(steps, data["accuracy"], color=colour, alpha=0.15, linewidth=0.7)
        ax_acc.plot(steps, smoothed(data["accuracy"], weight), color=colour, linestyle=style, linewidth=1.8, label=label)
        ax_scale.step(steps, data["loss_scale"], where="post", color=colour, linestyle=style, linewidth=1.5, label=label)
        skipped = [s for s, k in zip(steps, data["skipped"]) if k > 0]
        if skipped:
            any_skipped = True
            for ax in (ax_loss, ax_acc):  # red ticks along the bottom edge
                ax.vlines(skipped, 0, 0.08, transform=ax.get_xaxis_transform(), colors="red", linewidth=2)
            ax_scale.plot(skipped, [data["loss_scale"][s - 1] for s in skipped], "v", color="red", markersize=7)
        # Epoch boundaries, faint, where a run has more than one epoch.
        for s, (a, b) in enumerate(zip(data["epoch"], data["epoch"][1:]), start=1):
            if a != b:
                for ax in (ax_loss, ax_acc, ax_scale):
                    ax.axvline(s + 0.5, color=colour, alpha=0.25, linestyle=":", linewidth=1)

    if shadowed:  # one colour per layer, one line style per run
        # Layers that cost nothing (exact zeros: pooling, float32 layers) have no point on a log axis.
        def drawn(points):
            return any(math.isfinite(v) and v > 0 for _, v in points)
        layers = []
        for _, data in runs:
            layers += [name for name, points in data["shadow"].items() if drawn(points) and name not in layers]
        for i, (label, data) in enumerate(runs):
            for name, points in data["shadow"].items():
                if name not in layers:
                    continue
                k = layers.index(name)
                values = [v if math.isfinite(v) and v > 0 else math.nan for _, v in points]
                ax_shadow.plot([s for s, _ in points], values, color=colours[k % len(colours)],
                               linestyle=styles[i % len(styles)], marker=".", linewidth=1.2,
                               label=name if i == 0 else None)
        ax_shadow.set_yscale("log")
        ax_shadow.set_ylabel("error vs float32 twin")
        if layers:
            ax_shadow.legend(loc="best", fontsize="small", ncol=max(1, (len(layers) + 3) // 4), framealpha=0.7)
        ax_shadow.grid(True, alpha=0.3)
        ax_shadow.set_xlabel("step")

    ax_loss.set_ylabel("training loss")
    losses = [v for _, data in runs for v in data["loss"] if math.isfinite(v) and v > 0]
    if losses and max(losses) > 20 * min(losses):  # a log axis only where it shows more
        ax_loss.set_yscale("log")
    ax_acc.set_ylabel("training accuracy")
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_xlabel("" if shadowed else "step")
    for ax in (ax_loss, ax_acc, ax_scale):
        ax.grid(True, alpha=0.3)
    handles, labels = ax_loss.get_legend_handles_labels()
    if any_skipped:
        handles.append(matplotlib.lines.Line2D([], [], color="red", marker="|", linestyle="", markersize=10))
        labels.append("skipped step (NaN/inf gradient)")
    ax_loss.legend(handles, labels, loc="upper right")
    fig.suptitle(title or "training run" + ("s" if len(runs) > 1 else ""))
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(description="Plot mpx::fit CSV logs (loss, accuracy, loss scale, skipped steps).")
    parser.add_argument("csv", nargs="+", help="CSV logs written by mpx::fit (fit_options::csv_log)")
    parser.add_argument("-o", "--output", required=True, help="the PNG to write")
    parser.add_argument("--label", action="append", default=[],
                        help="a legend label per CSV, in order (default: the policy, else the file name)")
    parser.add_argument("--smooth", type=float, default=None,
                        help="weight of the moving average, in [0, 1): higher is smoother "
                             "(default: a window of 1/40 of the run, 2 to 100 steps)")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args(argv)
    if len(args.label) > len(args.csv):
        parser.error(f"{len(args.label)} labels for {len(args.csv)} CSV files")
    if args.smooth is not None and not 0 <= args.smooth < 1:
        parser.error("--smooth must be in [0, 1)")
    try:
        runs = []
        for i, path in enumerate(args.csv):
            data, policy = read_log(path)
            runs.append((args.label[i] if i < len(args.label) else label_for(path, policy), data))
    except LogError as e:
        print(f"plot_run.py: {e}", file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_run.py: matplotlib is not installed (pip install matplotlib, or scripts/setup.sh)", file=sys.stderr)
        return 3
    plot(runs, args.output, args.smooth, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
