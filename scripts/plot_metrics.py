#!/usr/bin/env python3
"""Plots the loss curves of trainer runs from their --metrics files (JSON lines with "step" and
"loss"), each as a moving average, into one PNG:

    /usr/bin/python3 scripts/plot_metrics.py out.png run.jsonl[=label] ... [--smooth 25] [--title T]
        [--val label=value ...]

--val draws a run's final validation loss as a dashed line. A label "torch X" is drawn dashed in
the colour of the run labelled "X" (PyTorch beside gradsync). Needs matplotlib (Debian:
apt-get install python3-matplotlib).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read(path):
    steps, losses = [], []
    with open(path) as lines:
        for line in lines:
            record = json.loads(line)
            if "loss" in record and "step" in record:
                steps.append(record["step"])
                losses.append(record["loss"])
    return steps, losses


def smooth(values, window):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("png")
    parser.add_argument("runs", nargs="+", help="metrics.jsonl or metrics.jsonl=label")
    parser.add_argument("--smooth", type=int, default=25, help="moving-average window in steps")
    parser.add_argument("--title", default="")
    parser.add_argument("--val", nargs="*", default=[], help="label=final validation loss")
    args = parser.parse_args()
    figure, axes = plt.subplots(figsize=(8, 4.5))
    colours = {}
    for run in args.runs:
        path, _, label = run.partition("=")
        label = label or path
        key = label[len("torch "):] if label.startswith("torch ") else label
        colour = colours.setdefault(key, f"C{len(colours)}")
        steps, losses = read(path)
        axes.plot(steps, smooth(losses, args.smooth), label=label, linewidth=1.2, color=colour,
                  linestyle="--" if label.startswith("torch ") else "-")
    for entry in args.val:
        label, _, value = entry.partition("=")
        axes.axhline(float(value), linestyle="--", linewidth=0.8, color="gray")
        axes.annotate(f"{label}: {float(value):.3f}", (0.99, float(value)), xycoords=("axes fraction", "data"),
                      ha="right", va="bottom", fontsize=8, color="gray")
    axes.set_xlabel("step")
    axes.set_ylabel(f"training loss (moving average of {args.smooth} steps)")
    if args.title:
        axes.set_title(args.title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)
    print(f"plot_metrics: wrote {args.png}")


if __name__ == "__main__":
    main()
