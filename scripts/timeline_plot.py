#!/usr/bin/env python3
"""Draws one training step of a timeline (scripts/timeline_merge.py's output, or one rank's
file) as a PNG: per rank, the backward passes and the optimizer step on the caller's track,
the collectives on the wire, the ready signals and the bucket launches as ticks. It shows at a
glance how much communication hides behind the backward.

    python3 scripts/timeline_plot.py run.json step.png [--step 3]

--step picks the k-th optimizer step (default: the last but one, a warm step). Needs matplotlib
(Debian: apt-get install python3-matplotlib).
"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def spans(events):
    """(pid, tid) -> [(begin, end, category, name)] from B/E pairs."""
    open_spans = defaultdict(list)
    result = defaultdict(list)
    for event in sorted(events, key=lambda e: e.get("ts", 0)):
        key = (event["pid"], event["tid"])
        if event["ph"] == "B":
            open_spans[key].append(event)
        elif event["ph"] == "E" and open_spans[key]:
            begin = open_spans[key].pop()
            result[key].append((begin["ts"], event["ts"], begin.get("cat", ""), begin.get("name", "")))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("png")
    parser.add_argument("--step", type=int, default=-2, help="which optimizer step (Python index; default -2)")
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    all_spans = spans(events)
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e["ph"] == "M" and e.get("name") == "thread_name"}
    ranks = sorted({pid for pid, _ in all_spans})
    # The window: from the end of the previous step on rank 0 to the end of the chosen one.
    steps = sorted(s for (pid, _), items in all_spans.items() if pid == ranks[0] for s in items if s[2] == "step")
    if len(steps) < 2:
        raise SystemExit("the trace holds fewer than two optimizer steps")
    index = args.step if args.step >= 0 else len(steps) + args.step
    index = max(1, min(index, len(steps) - 1))
    start, stop = steps[index - 1][1], steps[index][1]
    colors = {"backward": "#4c72b0", "step": "#55a868", "wire": "#dd8452", "wait": "#c44e52", "checkpoint": "#8172b2"}
    figure, axes = plt.subplots(figsize=(12, 1.2 + 1.1 * len(ranks)))
    labels, y = [], 0
    for rank in ranks:
        for (pid, tid), items in sorted(all_spans.items()):
            if pid != rank:
                continue
            visible = [s for s in items if s[1] >= start and s[0] <= stop]
            if not visible:
                continue
            # Longest first, so that nested spans (a wait inside a backward) stay visible on top.
            for begin, end, category, name in sorted(visible, key=lambda s: s[0] - s[1]):
                left, right = max(begin, start), min(end, stop)
                axes.broken_barh([((left - start) / 1e3, max((right - left) / 1e3, 0.01))], (y - 0.35, 0.7),
                                 facecolors=colors.get(category, "#999999"), edgecolor="none")
            labels.append(f"rank {rank}: {thread_names.get((pid, tid), f'thread {tid}')}")
            for event in events:
                if event["pid"] == rank and event.get("tid") == tid and event["ph"] == "i" and start <= event["ts"] <= stop:
                    mark = "|" if event.get("cat") == "bucket" else "."
                    axes.plot([(event["ts"] - start) / 1e3], [y + 0.42], marker=mark, color="black", markersize=6)
            y += 1
    axes.set_yticks(range(len(labels)))
    axes.set_yticklabels(labels)
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds into the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes.legend(handles, list(colors), loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(colors), frameon=False)
    axes.set_title(f"one training step: compute (backward, optimizer step) and buckets on the wire; "
                   f"'.' ready signals, '|' bucket launches")
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)
    print(f"step {index} of {len(steps)}: {(stop - start) / 1e3:.1f} ms -> {args.png}")


if __name__ == "__main__":
    main()
