#!/usr/bin/env python3
"""Turns a trainer's metrics file (--metrics run.jsonl) into a PNG loss curve:

    python3 examples/plot_metrics.py run.jsonl loss.png

Per-step loss as a thin line, per-epoch loss and held-out accuracy as markers. Needs
matplotlib (Debian: apt-get install python3-matplotlib); the trainers themselves never need Python.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("source", help="a metrics file written with --metrics")
parser.add_argument("target", help="the PNG to write")
arguments = parser.parse_args()
source, target = arguments.source, arguments.target
steps, losses, epoch_steps, epoch_losses, accuracies = [], [], [], [], []
for line in open(source):
    record = json.loads(line)
    if "loss" in record:
        steps.append(record["step"])
        losses.append(record["loss"])
    if "accuracy" in record:
        epoch_steps.append(record["step"])
        epoch_losses.append(record["epoch_loss"])
        accuracies.append(100 * record["accuracy"])

figure, loss_axis = plt.subplots(figsize=(8, 4.5))
loss_axis.plot(steps, losses, linewidth=0.6, color="tab:blue", label="step loss")
loss_axis.plot(epoch_steps, epoch_losses, "o-", color="tab:blue", label="epoch loss")
loss_axis.set_xlabel("step")
loss_axis.set_ylabel("loss")
loss_axis.set_yscale("log")
accuracy_axis = loss_axis.twinx()
accuracy_axis.plot(epoch_steps, accuracies, "s--", color="tab:green", label="held-out accuracy")
accuracy_axis.set_ylabel("held-out accuracy (%)")
figure.legend(loc="upper center", ncol=3)
figure.tight_layout()
figure.savefig(target, dpi=120)
print(f"{target}: {len(steps)} steps, {len(epoch_steps)} epochs")
