#!/usr/bin/env python3
"""Checks a fault-tolerant run's --record-samples file: no sample lost, none trained twice.

Every group's rank 0 writes one line per step it committed: the step, the data position before
it, the step's global batch (members x group batch) and the group's own slice. The committed
steps must follow one another without a gap (step s+1 starts where step s ended), every group
that recorded a step must agree on it, and the slices of one step must be distinct places of
it. So the committed steps trained the stream's samples [0, end) exactly once each.

The job never goes back: each group's lines (appended, one write each) must name ever higher
steps. A group that committed a step at or below one it had committed before was in a quorum
formed below the high-water mark. (Across groups the lines need not be in order: a group stopped
between a commit and its line writes it late.) A step committed twice is caught above too.

    check_samples.py RECORDS [--at-least N]   N: the samples the run had to consume
"""
import json
import sys


def main():
    path = sys.argv[1]
    at_least = int(sys.argv[sys.argv.index("--at-least") + 1]) if "--at-least" in sys.argv else 0
    steps = {}
    highest = {}
    with open(path, encoding="utf-8") as records:
        for number, line in enumerate(records, 1):
            record = json.loads(line)
            before = highest.get(record["group"], 0)
            if record["step"] <= before:
                sys.exit(f"{path}:{number}: group {record['group']} committed step {record['step']} after it had "
                         f"committed step {before}: the job went back")
            highest[record["group"]] = record["step"]
            steps.setdefault(record["step"], []).append((number, record))
    if not steps:
        sys.exit(f"{path}: no committed step recorded")
    position = 0
    members_seen = {}
    for step in range(1, max(steps) + 1):
        if step not in steps:
            sys.exit(f"{path}: step {step} was committed by no group that recorded it (a gap in the stream)")
        records = steps[step]
        first = records[0][1]
        if first["position"] != position:
            sys.exit(f"{path}: step {step} starts at sample {first['position']}, the step before ended at {position}")
        places = set()
        for number, record in records:
            if (record["position"], record["count"]) != (first["position"], first["count"]):
                sys.exit(f"{path}:{number}: group {record['group']} disagrees on step {step}: {record} vs {first}")
            offset = record["first"] - record["position"]
            if offset % record["size"] != 0 or not 0 <= offset < record["count"]:
                sys.exit(f"{path}:{number}: group {record['group']}'s slice is not a place of step {step}: {record}")
            place = offset // record["size"]
            if place in places and (place, record["group"]) not in places:
                sys.exit(f"{path}:{number}: two groups trained slice {place} of step {step}")
            places.add(place)
        members = first["count"] // first["size"]
        members_seen[members] = members_seen.get(members, 0) + 1
        position += first["count"]
    if position < at_least:
        sys.exit(f"{path}: the committed steps consumed {position} samples, the run needed {at_least}")
    by_members = ", ".join(f"{count} with {members} group(s)" for members, count in sorted(members_seen.items()))
    print(f"{path}: {max(steps)} committed steps trained samples [0, {position}) exactly once each ({by_members})")


if __name__ == "__main__":
    main()
