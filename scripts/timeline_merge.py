#!/usr/bin/env python3
"""Merges the per-rank timeline files a run wrote (GRADSYNC_TIMELINE=run.json or a trainer's
--timeline run.json gives run.rank0.json, run.rank1.json, ...) into one Chrome trace, ranks as
processes, for Perfetto (ui.perfetto.dev) or chrome://tracing:

    python3 scripts/timeline_merge.py run.json            # reads run.rank*.json, writes run.json
    python3 scripts/timeline_merge.py out.json a.json b.json

Timestamps are wall-clock microseconds, so the ranks line up (on one machine exactly; across
machines as well as their clocks agree). Needs only the Python standard library.
"""
import argparse
import glob
import json
import os


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the merged trace to write (also names the rank files when none are given)")
    parser.add_argument("inputs", nargs="*", help="the ranks' files (default: OUTPUT's stem + .rank*.json)")
    args = parser.parse_args()
    inputs = args.inputs
    if not inputs:
        stem, extension = os.path.splitext(args.output)
        inputs = sorted(glob.glob(f"{stem}.rank*{extension or '.json'}"),
                        key=lambda name: int(name.rsplit(".rank", 1)[1].split(".")[0]))
    if not inputs:
        parser.error("no rank files found")
    events = []
    for name in inputs:
        with open(name) as handle:
            events += json.load(handle)["traceEvents"]
    with open(args.output, "w") as handle:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, handle)
    print(f"{len(inputs)} rank file(s), {len(events)} events -> {args.output}")


if __name__ == "__main__":
    main()
