#!/usr/bin/python3
"""Plots trainer runs from their --metrics files (JSON lines: "step" and "loss" per step; the
digits trainers also write "epoch_loss" and "accuracy" per epoch) into one PNG:

    scripts/plot_metrics.py out.png run.jsonl[=label] ... [--smooth N] [--title T] [--val label=value ...]
    scripts/plot_metrics.py out.png run.jsonl[=label] ... --wallclock [--title T]

Each run's step loss is drawn as a moving average of --smooth steps (1: as it is; default 25). A
run with epoch records adds its per-epoch loss as markers and its held-out accuracy on a second
axis. A label "torch X" is drawn dashed in the colour of the run labelled "X" (PyTorch beside
gradsync); --val draws a run's final validation loss as a dashed line. The loss axis is
logarithmic when a run has epoch records (the digits trainers' loss falls by orders), linear
otherwise. --wallclock draws instead each run's validation-loss records (gpt_ddp --val-every)
against the seconds since its start: strategies compared for the same wall-clock budget. Needs
matplotlib: scripts/plot_metrics.sh installs it when missing and runs this.
"""
import argparse
import json
import sys


def read(path):
    """A run's step losses and its epoch records: (steps, losses), (steps, epoch losses, accuracies)."""
    steps, losses, epochs = [], [], ([], [], [])
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                sys.exit(f"plot_metrics: {path}:{number}: not a JSON line ({error})")
            if "loss" in record and "step" in record:
                steps.append(record["step"])
                losses.append(record["loss"])
            if "accuracy" in record and "epoch_loss" in record:
                epochs[0].append(record["step"])
                epochs[1].append(record["epoch_loss"])
                epochs[2].append(100 * record["accuracy"])
    if not steps and not epochs[0]:
        sys.exit(f"plot_metrics: {path} holds no step or epoch records")
    return (steps, losses), epochs


def read_validation(path):
    """A run's validation-loss records: (seconds, losses)."""
    seconds, losses = [], []
    with open(path) as lines:
        for line in lines:
            record = json.loads(line)
            if "val_loss" in record and "seconds" in record:
                seconds.append(record["seconds"])
                losses.append(record["val_loss"])
    if not seconds:
        sys.exit(f"plot_metrics: {path} holds no validation-loss records (gpt_ddp --val-every)")
    return seconds, losses


def plot_wallclock(axes, runs):
    for number, run in enumerate(runs):
        path, _, label = run.partition("=")
        seconds, losses = read_validation(path)
        axes.plot(seconds, losses, "o-", markersize=3, linewidth=1.2, label=label or path, color=f"C{number}")
        print(f"{path}: {len(seconds)} validation points, last {losses[-1]:.4f} at {seconds[-1]:.1f} s")
    axes.set_xlabel("wall-clock seconds")
    axes.set_ylabel("validation loss")


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
    parser.add_argument("--smooth", type=int, default=25, help="moving-average window in steps (1: none)")
    parser.add_argument("--title", default="")
    parser.add_argument("--val", nargs="*", default=[], help="label=final validation loss")
    parser.add_argument("--wallclock", action="store_true", help="validation loss against seconds")
    args = parser.parse_args()
    if args.smooth < 1:
        parser.error("--smooth must be at least 1")
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_metrics: needs matplotlib (Debian: apt-get install python3-matplotlib; "
                 "scripts/plot_metrics.sh installs it)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(8, 4.5))
    if args.wallclock:
        plot_wallclock(axes, args.runs)
        if args.title:
            axes.set_title(args.title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(args.png, dpi=110)
        print(f"plot_metrics: wrote {args.png}")
        return
    accuracy_axis = None
    colours = {}
    for run in args.runs:
        path, _, label = run.partition("=")
        label = label or path
        key = label[len("torch "):] if label.startswith("torch ") else label
        colour = colours.setdefault(key, f"C{len(colours)}")
        (steps, losses), (epoch_steps, epoch_losses, accuracies) = read(path)
        axes.plot(steps, smooth(losses, args.smooth), label=label, linewidth=1.2 if args.smooth > 1 else 0.6,
                  color=colour, linestyle="--" if label.startswith("torch ") else "-")
        if epoch_steps:
            axes.plot(epoch_steps, epoch_losses, "o", color=colour, label=f"{label}: epoch loss")
            axes.set_yscale("log")
            accuracy_axis = accuracy_axis or axes.twinx()
            accuracy_axis.plot(epoch_steps, accuracies, "s--", color=colour, alpha=0.6,
                               label=f"{label}: held-out accuracy")
        print(f"{path}: {len(steps)} steps, {len(epoch_steps)} epochs")
    for entry in args.val:
        label, _, value = entry.partition("=")
        axes.axhline(float(value), linestyle="--", linewidth=0.8, color="gray")
        axes.annotate(f"{label}: {float(value):.3f}", (0.99, float(value)), xycoords=("axes fraction", "data"),
                      ha="right", va="bottom", fontsize=8, color="gray")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss" + (f" (moving average of {args.smooth} steps)" if args.smooth > 1 else ""))
    if accuracy_axis is not None:
        accuracy_axis.set_ylabel("held-out accuracy (%)")
    if args.title:
        axes.set_title(args.title)
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if accuracy_axis is not None:
        more = accuracy_axis.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    axes.legend(handles, labels, fontsize=8)
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)
    print(f"plot_metrics: wrote {args.png}")


if __name__ == "__main__":
    main()
