#!/usr/bin/env python3
"""Reads every rank's flight record and says which ranks are behind, and where.

    scripts/flight_report.py DIR [--world N] [--verbose]

DIR holds the dumps (rank<R>.json) that ranks write into GRADSYNC_FLIGHT_RECORDER_DIR on a
timeout, a collective mismatch or a lost peer, on SIGUSR1, or through
comm::dump_flight_records (gradsync/comm/records/flight_recorder.h). For each communicator, by name:

  * a mismatch: at the same sequence number, ranks that run different collectives (and, when a
    rank's operation is what the others run next, that it skipped one);
  * who is behind: the ranks that never issued the collective the others are waiting in, with
    their last operation and how long the others have waited;
  * ranks with no dump (stopped, killed, or never configured), when the world size is known;
  * ranks that dumped while still connecting (no communicator yet), and where they waited.

A dump that cannot be trusted (unreadable, empty, truncated, not JSON, not a flight record, a
rank that is negative or outside the world, two files claiming one rank) is named with why and
left out; the report goes on with the others.

Exit status 0 (the report is the output); 2 when DIR holds no usable dump.
"""
import argparse
import glob
import json
import os
import sys


FORMAT = "gradsync-flight-record/1"
ENTRY_FIELDS = {"seq": int, "state": str, "what": str, "issued_us": int}
RECORD_FIELDS = {"name": str, "size": int, "backend": str, "entries": list}


def checked_dump(path, world):
    """The dump in `path`, or the reason it cannot be trusted."""
    if not os.path.isfile(path):
        return None, "not a file"
    try:
        with open(path, "rb") as file:
            raw = file.read(64 << 20)
        if not raw.strip():
            return None, "empty"
        dump = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not text (binary)"
    except json.JSONDecodeError as error:
        return None, f"not whole JSON ({error.msg} at byte {error.pos}: truncated?)"
    except RecursionError:  # a dump is a few levels deep; thousands are not a flight record
        return None, "nested too deep to be a flight record"
    except OSError as error:
        return None, f"unreadable ({error.strerror})"
    if not isinstance(dump, dict) or dump.get("format") != FORMAT:
        return None, f"not a flight record (no \"format\": \"{FORMAT}\")"
    rank = dump.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0 or (world and rank >= world):
        return None, f"its rank {rank!r} is not one of the job's" + (f" (0 to {world - 1})" if world else "")
    if not isinstance(dump.get("dumped_us"), int) or not isinstance(dump.get("reason"), str):
        return None, "no dumped_us or reason"
    records = dump.get("communicators")
    if not isinstance(records, list):
        return None, "no list of communicators"
    for record in records:
        if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in RECORD_FIELDS.items()):
            return None, "a communicator without its name, size, backend or entries"
        for entry in record["entries"]:
            if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) for k, t in ENTRY_FIELDS.items()):
                return None, f"an entry of communicator {record['name']} without its seq, state, what or issued_us"
    return dump, None


def load(folder, world):
    """{rank: dump} of the trustworthy dumps, and a line for each one left out."""
    found, problems = {}, []
    for path in sorted(glob.glob(os.path.join(folder, "rank*.json"))):
        dump, why = checked_dump(path, world)
        if why:
            problems.append(f"{os.path.basename(path)}: left out: {why}")
            continue
        found.setdefault(dump["rank"], []).append((os.path.basename(path), dump))
    dumps = {}
    for rank, claims in sorted(found.items()):
        if len(claims) > 1:
            names = " and ".join(name for name, _ in claims)
            problems.append(f"{names} all claim rank {rank}: left out (which one is rank {rank}'s cannot be told)")
        else:
            dumps[rank] = claims[0][1]
    return dumps, problems


def signature(entry):
    """What must agree across ranks for one collective."""
    return (entry.get("op"), entry.get("reduce"), entry.get("root"), entry.get("dtype"), entry.get("count"))


def describe(entry):
    label = f" [{entry['label']}]" if entry.get("label") else ""
    return f"{entry['what']}{label}"


def ranks_text(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def run_verb(ranks):
    return "runs" if len(ranks) == 1 else "run"


def wait_verb(ranks):
    return "waits" if len(ranks) == 1 else "wait"


def seconds(later_us, earlier_us):
    return f"{(later_us - earlier_us) / 1e6:.1f} s"


def report_communicator(name, views, world, dumps):
    """views: rank -> (communicator record, dump). Returns the report's lines."""
    lines = []
    collectives = {}  # rank -> {seq: entry}
    for rank, (record, _) in views.items():
        collectives[rank] = {e["seq"]: e for e in record["entries"] if "p2p" not in e}
    size = max(record["size"] for record, _ in views.values())
    backend = next(iter(views.values()))[0]["backend"]
    lines.append(f"communicator {name} ({backend}, {size} ranks; dumps from {ranks_text(views)}):")

    # 1. Mismatches: the first sequence number at which the ranks disagree. A mismatch is the
    # story: the ranks stop there, so who issued what afterwards says nothing more.
    mismatch = False
    seqs = sorted(set().union(*[set(c) for c in collectives.values()]))
    for seq in seqs:
        present = {rank: c[seq] for rank, c in collectives.items() if seq in c}
        groups = {}
        for rank, entry in present.items():
            groups.setdefault(signature(entry), []).append(rank)
        if len(groups) < 2:
            continue
        # The majority is what the job meant; the others deviate.
        majority = max(groups.values(), key=len)
        major_entry = present[majority[0]]
        lines.append(f"  mismatch at #{seq}: {ranks_text(majority)} {run_verb(majority)} {describe(major_entry)}")
        for ranks in groups.values():
            if ranks is majority:
                continue
            entry = present[ranks[0]]
            line = f"    but {ranks_text(ranks)} {run_verb(ranks)} {describe(entry)}"
            following = collectives[majority[0]].get(seq + 1)
            if following is not None and signature(following) == signature(entry) and \
                    following.get("label") == entry.get("label"):
                line += f", the others' #{seq + 1}: {ranks_text(ranks)} skipped #{seq}"
            lines.append(line)
        mismatch = True
        break

    # 2. Progress: the last collective each rank issued, and what it waits in.
    last = {rank: max(c) if c else -1 for rank, c in collectives.items()}
    front = max(last.values())
    open_ops = {}
    for rank, c in collectives.items():
        waiting = [e for e in c.values() if e["state"] in ("issued", "started", "timed out", "failed")]
        if waiting:
            open_ops[rank] = min(waiting, key=lambda e: e["seq"])
    behind = [] if mismatch else sorted(rank for rank, seq in last.items() if seq < front)
    if behind:
        ahead = sorted(rank for rank in last if rank not in behind)
        # What the ranks that are ahead wait in: their earliest open operation the laggards never issued.
        waited = [open_ops[r] for r in ahead if r in open_ops]
        target = min(waited, key=lambda e: e["seq"]) if waited else None
        if target is not None:
            dumped = max(views[r][1]["dumped_us"] for r in ahead)
            lines.append(f"  {ranks_text(ahead)} {wait_verb(ahead)} in {describe(target)} "
                         f"(issued {seconds(dumped, target['issued_us'])} before their dump), "
                         f"which {ranks_text(behind)} never issued")
        for rank in behind:
            c = collectives[rank]
            if not c:
                lines.append(f"  rank {rank} is behind: it issued no collective on this communicator")
                continue
            entry = c[last[rank]]
            state = entry["state"]
            lines.append(f"  rank {rank} is behind: its last collective is {describe(entry)}, {state}"
                         f" (dumped for: {views[rank][1]['reason']})")
    elif open_ops and not mismatch:
        # Everyone issued the same collectives; name where they are stuck.
        seq = min(e["seq"] for e in open_ops.values())
        stuck = sorted(r for r, e in open_ops.items() if e["seq"] == seq)
        lines.append(f"  {ranks_text(stuck)} {wait_verb(stuck)} in {describe(open_ops[stuck[0]])}; every dumped rank issued it")

    if world:
        missing = sorted(set(range(world)) - set(dumps))
        if missing:
            lines.append(f"  no dump from {ranks_text(missing)} (stopped, killed, or without GRADSYNC_FLIGHT_RECORDER_DIR)"
                         + (": the likeliest culprit" if not behind else ""))
    if len(lines) == 1:
        lines.append("  every dumped rank completed every collective it issued")
    failed = sorted(rank for rank, (record, _) in views.items() if record.get("broken"))
    if failed:
        first = views[failed[0]][0]["broken"].replace(f"rank {failed[0]}: ", "", 1)
        others = f" ({ranks_text(failed[1:])} failed too)" if len(failed) > 1 else ""
        lines.append(f"  rank {failed[0]} failed: {first[:300]}{others}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--world", type=int, default=0, help="the job's world size, to name ranks without a dump")
    args = parser.parse_args()
    if not os.path.isdir(args.folder):
        print(f"{args.folder} is not a folder of flight records")
        return 2
    dumps, problems = load(args.folder, args.world)
    for line in problems:
        print(line)
    if not dumps:
        print(f"no usable flight records (rank*.json) in {args.folder}")
        return 2
    world = args.world
    by_name = {}
    for rank, dump in dumps.items():
        if not dump["communicators"] and dump.get("connecting"):
            print(f"rank {rank} has no communicator yet: it waits at {dump['connecting']} (dumped for: {dump['reason']})")
        for record in dump["communicators"]:
            by_name.setdefault(record["name"], {})[rank] = (record, dump)
            world = max(world, record["size"]) if not args.world else world
    for name in sorted(by_name, key=lambda n: (n.count("/"), n)):
        for line in report_communicator(name, by_name[name], world, dumps):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
