#!/usr/bin/env python3
"""The table of benchmarks/fault_tolerance.sh, from the runs it left in OUT.

    fault_tolerance_report.py OUT

replicas_plain / replicas_killed: 3 replica groups (one torchrun agent each) and the coordinator;
restarts_plain / restarts_killed: one torchrun of 6 ranks with --max-restarts and checkpoints.
For the killed runs, each kill (OUT/<run>/kills.txt: unix time, committed step, group) is lined
up with what followed it: the survivors' next committed step and the replacement's recovery
(replica groups, from the groups' metrics' unix_time), or the step the restart resumed from.
With OUT/stop.txt (fault_tolerance.sh --stop), the stops of the one replica run instead.
"""
import json
import os
import re
import statistics
import sys


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def read_kills(run):
    path = os.path.join(run, "kills.txt")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as lines:
        return [(float(t), int(step), int(group)) for t, step, group, _ in (line.split() for line in lines)]


def wall(run):
    with open(os.path.join(run, "finished"), encoding="utf-8") as finished:
        end, start, status = finished.read().split()
    return float(end) - float(start), int(status)


def final(records):
    epochs = [r for r in records if "accuracy" in r]
    return (epochs[-1]["epoch_loss"], epochs[-1]["accuracy"], epochs[-1]["step"]) if epochs else (float("nan"),) * 3


def spread(values):
    if not values:
        return "-"
    return f"median {statistics.median(values):.2f} s, max {max(values):.2f} s"


def replicas(out, name):
    run = os.path.join(out, name)
    groups = [read_jsonl(os.path.join(run, f"group{g}.jsonl")) for g in range(3)]
    seconds, status = wall(run)
    kills = read_kills(run)
    next_commit, rejoin, without = [], [], []
    for when, _, group in kills:
        # (a stop: the first commit of a quorum without the stopped group, which had to be left out)
        alone = [r["unix_time"] for g, records in enumerate(groups) if g != group for r in records
                 if "loss" in r and "event" not in r and r["unix_time"] > when and r.get("members", 3) < 3]
        if alone:
            without.append(min(alone) - when)
        commits = [r["unix_time"] for g, records in enumerate(groups) if g != group for r in records
                   if "loss" in r and "event" not in r and r["unix_time"] > when]
        if commits:
            next_commit.append(min(commits) - when)
        recovered = [r["unix_time"] for r in groups[group] if r.get("event") == "recovered" and r["unix_time"] > when]
        if recovered:
            rejoin.append(min(recovered) - when)
    discarded = {(r["quorum"], r["step"]) for records in groups for r in records if r.get("event") == "discarded"}
    loss, accuracy, steps = final(groups[0])
    samples = open(os.path.join(run, "samples.txt"), encoding="utf-8").read().strip() if os.path.exists(
        os.path.join(run, "samples.txt")) else ""
    return {"run": name, "wall": seconds, "status": status, "kills": len(kills), "steps": steps,
            "lost": len(discarded), "next_commit": next_commit, "rejoin": rejoin, "without": without, "loss": loss,
            "accuracy": accuracy, "samples": samples}


def recoveries(out, name):
    """Each recovery's source side: its bytes per rank and seconds ("sent" events), and Gloo's raw
    broadcast between two ranks at the nearest size (OUT/raw_collectives.txt, bench_collectives)."""
    run = os.path.join(out, name)
    sent = []
    for g in range(3):
        for r in read_jsonl(os.path.join(run, f"group{g}.jsonl")):
            found = re.search(r"\((\d+) bytes from this rank.*met in ([0-9.]+) ms, sent in ([0-9.]+) ms",
                              r.get("detail", "")) if r.get("event") == "sent" else None
            if found and float(found.group(3)) > 0:
                sent.append((int(found.group(1)), float(found.group(3)) / 1000, "its pieces" in r["detail"],
                             float(found.group(2)) / 1000))
    if not sent:
        return
    bytes_each = statistics.median(b for b, _, _, _ in sent)
    rates = [b / t / 1e6 for b, t, _, _ in sent]
    pieces = "by pieces (ZeRO: each source rank sends only its own)" if all(p for _, _, p, _ in sent) else "whole"
    print(f"recoveries: {len(sent)} transfers {pieces}, median {bytes_each:.0f} bytes per source rank; the pair met "
          f"in a median {statistics.median(m for _, _, _, m in sent) * 1000:.1f} ms, then sent in "
          f"{statistics.median(t for _, t, _, _ in sent) * 1000:.2f} ms: {statistics.median(rates):.1f} MB/s")
    raw_path = os.path.join(out, "raw_collectives.txt")
    if os.path.exists(raw_path):
        rows = [line.split() for line in open(raw_path, encoding="utf-8") if line.startswith("broadcast")]
        rows = [(int(r[1]), float(r[5])) for r in rows if len(r) > 5]
        if rows:
            size, raw_us = min(rows, key=lambda r: abs(r[0] - bytes_each))
            print(f"  the raw transport in the same run: Gloo's broadcast of {size} bytes between two ranks, "
                  f"{raw_us:.0f} us = {size / raw_us:.1f} MB/s (bench_collectives' raw call)")
    inside_path = os.path.join(out, "inside.txt")
    if os.path.exists(inside_path):
        print(f"  inside the groups: {open(inside_path, encoding='utf-8').read().strip()}")


def restarts(out, name):
    run = os.path.join(out, name)
    seconds, status = wall(run)
    kills = read_kills(run)
    with open(os.path.join(run, "run.log"), encoding="utf-8", errors="replace") as log:
        resumed = [int(m.group(1)) for m in re.finditer(r"resuming from \S*step_(\d+)\.safetensors", log.read())]
    lost = [step - resumed_at for (_, step, _), resumed_at in zip(kills, resumed)]
    loss, accuracy, steps = final(read_jsonl(os.path.join(run, "metrics.jsonl")))
    return {"run": name, "wall": seconds, "status": status, "kills": len(kills), "steps": steps, "lost": sum(lost),
            "lost_each": lost, "loss": loss, "accuracy": accuracy}


def stopped(out, mode):
    """benchmarks/fault_tolerance.sh --stop: what each stop cost the other groups."""
    run = replicas(out, "replicas_killed")
    what = {"group": "a whole group (SIGSTOP, SIGCONT later)",
            "rank": "one rank that is not its group's leader (SIGSTOP, SIGCONT later)",
            "partition": "a group's network (its link down, up again later)"}[mode]
    print(f"{run['kills']} stops of {what}; status {run['status']}, {run['steps']} steps, "
          f"held-out accuracy {run['accuracy'] * 100:.2f}%")
    print(f"  the survivors' first commit without the stopped group: {spread(run['without'])} "
          f"({len(run['without'])} of {run['kills']}; each: {', '.join(f'{s:.2f}' for s in run['without'])})")
    print(f"  the stopped group recovered and rejoined after: {spread(run['rejoin'])} "
          f"({len(run['rejoin'])} of {run['kills']})")
    print(f"  {run['samples']}")


def main():
    out = sys.argv[1]
    if os.path.exists(os.path.join(out, "stop.txt")):
        stopped(out, open(os.path.join(out, "stop.txt"), encoding="utf-8").read().strip())
        return
    rows = [replicas(out, "replicas_plain"), replicas(out, "replicas_killed"), restarts(out, "restarts_plain"),
            restarts(out, "restarts_killed")]
    print(f"{'run':<17}{'status':>7}{'kills':>6}{'wall s':>8}{'steps':>7}{'steps lost':>11}{'loss':>8}{'accuracy':>10}")
    for r in rows:
        print(f"{r['run']:<17}{r['status']:>7}{r['kills']:>6}{r['wall']:>8.1f}{r['steps']:>7}{r['lost']:>11}"
              f"{r['loss']:>8.4f}{r['accuracy'] * 100:>9.2f}%")
    plain, killed, restart_plain, restart_killed = rows
    if killed["kills"]:
        print(f"replica groups, per failure: {(killed['wall'] - plain['wall']) / killed['kills']:.2f} s of wall clock, "
              f"{killed['lost'] / killed['kills']:.2f} steps discarded")
        print(f"  the survivors' next committed step after a kill: {spread(killed['next_commit'])}")
        print(f"  the replacement recovered and rejoined after: {spread(killed['rejoin'])} "
              f"({len(killed['rejoin'])} of {killed['kills']})")
        print(f"  {killed['samples']}")
        recoveries(out, "replicas_killed")
    noise = sorted(name for name in os.listdir(out) if name.startswith("replicas_seed"))
    if noise:
        accuracies = [plain["accuracy"]] + [replicas(out, name)["accuracy"] for name in noise]
        print(f"uninterrupted replica runs (seed 3 and {', '.join(n[len('replicas_seed'):] for n in noise)}): held-out "
              f"accuracy {', '.join(f'{a * 100:.2f}%' for a in accuracies)} (spread "
              f"{(max(accuracies) - min(accuracies)) * 100:.2f} points); the killed run: {killed['accuracy'] * 100:.2f}%")
    if restart_killed["kills"]:
        print(f"torchrun --max-restarts with checkpoints, per failure: "
              f"{(restart_killed['wall'] - restart_plain['wall']) / restart_killed['kills']:.2f} s of wall clock, "
              f"{restart_killed['lost'] / restart_killed['kills']:.2f} steps lost (each: {restart_killed['lost_each']})")


if __name__ == "__main__":
    main()
