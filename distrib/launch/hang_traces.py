"""Reading the hang dumps of a run (run.dir/hang/rank_N.trace, written by distrib.distributed.hang) and the one line
that compares them: the collective, and the ranks that did not enter it (torch's fr_trace analyzer fails on CPU
dumps). The launcher reads them after a failed run: plain pickles, no torch needed."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

STOPPED_AFTER_S = 5.0  # a watch thread that did not run for this long was stopped with its process (SIGSTOP)
_TRACE = re.compile(r"^rank_(\d+)(\.trace)?$")


def read_traces(directory: Path, since_ns: int = 0) -> dict[int, dict]:
    """Every rank's trace in the folder written since `since_ns` (an earlier run's are left out), by rank."""
    traces = {}
    for path in Path(directory).glob("rank_*"):
        match = _TRACE.match(path.name)
        try:
            if match and path.stat().st_mtime_ns >= since_ns:
                traces[int(match.group(1))] = pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            continue
    return traces


def divergence(traces: dict[int, dict], world_size: int | None = None) -> str:
    """One line from every rank's trace: the first collective (in time) that some ranks of its process group
    entered and others did not, or, when the ranks that left a trace entered the same ones, the last of them; with
    the ranks that were stopped (their watch thread did not run) and the ranks that left no trace. A rank's
    collectives created after the first dump, or after it was stopped (its trace's stopped_since_ns), are left out
    of the comparison and named apart: a stopped rank that runs again once the others gave up enters collectives
    then, which its trace, dumped later, lists."""
    dumped = [trace["distrib"]["dumped_ns"] for trace in traces.values() if "distrib" in trace]
    first_dump = min(dumped) if dumped else None
    limits = {rank: _limit(trace, first_dump) for rank, trace in traces.items()}
    ranks = {rank: _collectives(trace, limits[rank]) for rank, trace in traces.items()}
    found = [split for group in sorted({g for by_group in ranks.values() for g in by_group})
             if (split := _split(group, ranks)) is not None]
    if found:
        _, line, behind = min(found)
        line += "".join(_where(rank, traces[rank]) for rank in behind)
    else:
        last = [entries[-1] for by_group in ranks.values() for entries in by_group.values() if entries]
        if not last:
            return "no rank's trace holds a collective"
        newest = max(last, key=lambda entry: entry["time_created_ns"])
        every = world_size is None or set(traces) == set(range(world_size))
        line = (f"{'every rank' if every else _ranks(sorted(traces))} entered {_op(newest)} "
                f"#{newest['collective_seq_id']} of {_group(newest)}, the last collective, and none went past it")
    stopped = {rank: trace["distrib"]["stopped_s"] for rank, trace in sorted(traces.items())
               if trace.get("distrib", {}).get("stopped_s", 0) >= STOPPED_AFTER_S}
    line += "".join(f"; rank {rank} did not run for {seconds:g} s (stopped)" for rank, seconds in stopped.items())
    line += "".join(_later(rank, traces[rank], limits[rank]) for rank in sorted(traces))
    missing = sorted(set(range(world_size or 0)) - set(traces))
    return line + (f"; no trace from {_ranks(missing)}" if missing else "")


def _limit(trace: dict, first_dump_ns: int | None) -> int | None:
    """The time after which a rank's collectives are left out: the first dump, or, for a rank that was stopped, the
    moment its stop had begun by (whichever is earlier); None for torch's own dumps, which say neither."""
    since = trace.get("distrib", {}).get("stopped_since_ns")
    times = [t for t in (first_dump_ns, since) if t is not None]
    return min(times) if times else None


def _later(rank: int, trace: dict, limit_ns: int | None) -> str:
    """What a rank's trace lists past its limit: the collectives it entered once it ran again (or after the first
    dump), which the comparison left out."""
    later = sorted((e for e in trace.get("entries", []) if not e.get("is_p2p") and limit_ns is not None
                    and e["time_created_ns"] > limit_ns), key=lambda e: e["time_created_ns"])
    if not later:
        return ""
    since = trace.get("distrib", {}).get("stopped_since_ns")
    what = f"{_op(later[0])} #{later[0]['collective_seq_id']} of {_group(later[0])}" + (
        f" and {len(later) - 1} more" if len(later) > 1 else "")
    if since is not None and later[0]["time_created_ns"] > since:
        return f"; rank {rank}'s trace, dumped once it ran again, also lists {what}, which it entered then"
    return f"; rank {rank}'s trace also lists {what}, entered after the first rank dumped"


def _collectives(trace: dict, cutoff_ns: int | None) -> dict[str, list[dict]]:
    """A rank's collectives (point-to-point operations left out) by process group, in order of their sequence."""
    by_group: dict[str, list[dict]] = {group: [] for group in trace.get("pg_status", {})}
    for entry in trace.get("entries", []):
        if not entry.get("is_p2p") and (cutoff_ns is None or entry["time_created_ns"] <= cutoff_ns):
            by_group.setdefault(entry["process_group"][0], []).append(entry)
    return {group: sorted(entries, key=lambda e: e["collective_seq_id"]) for group, entries in by_group.items()}


def _split(group: str, ranks: dict[int, dict[str, list[dict]]]) -> tuple[int, str, list[int]] | None:
    """(when it was entered, the line, the ranks behind) for the first collective of `group` that its ranks did not
    all enter, or that they entered as different collectives; None when they agree."""
    members = {rank: by_group[group] for rank, by_group in ranks.items() if group in by_group}
    last = {rank: entries[-1]["collective_seq_id"] if entries else 0 for rank, entries in members.items()}
    common = min(last.values())
    at_common = {rank: next((e for e in reversed(entries) if e["collective_seq_id"] == common), None)
                 for rank, entries in members.items()}
    names = {rank: _op(entry) for rank, entry in at_common.items() if entry is not None}
    if len(set(names.values())) > 1:
        entry = next(e for e in at_common.values() if e is not None)
        said = "; ".join(f"{_ranks([rank for rank in names if names[rank] == name])} {name}"
                         for name in sorted(set(names.values())))
        return entry["time_created_ns"], f"the ranks ran different collectives as #{common} of {_group(entry)}: " \
            f"{said}", []
    if common == max(last.values()):
        return None
    entered = sorted(rank for rank, seq in last.items() if seq > common)
    behind = sorted(rank for rank, seq in last.items() if seq == common)
    entry = min((e for rank in entered for e in members[rank] if e["collective_seq_id"] > common),
                key=lambda e: (e["collective_seq_id"], e["time_created_ns"]))
    return entry["time_created_ns"], (f"{_ranks(behind)} did not enter {_op(entry)} #{entry['collective_seq_id']} "
                                      f"of {_group(entry)} ({_ranks(entered)} entered it; last common sequence "
                                      f"{common})"), behind


def _where(rank: int, trace: dict) -> str:
    """Where a rank's main thread was when its watch dumped (its innermost frame), if the watch recorded it; not for
    a stopped rank, whose main thread ran on, once continued, before its watch dumped."""
    stack = trace.get("distrib", {}).get("main_stack")
    if not stack or trace["distrib"].get("stopped_s", 0) >= STOPPED_AFTER_S:
        return ""
    filename, line, name = stack[-1]
    return f"; rank {rank} was in {name} ({Path(filename).name}:{line})"


def _op(entry: dict) -> str:
    return entry["profiling_name"].split(":", 1)[-1]  # "gloo:all_reduce" -> "all_reduce"


def _group(entry: dict) -> str:
    name, desc = entry["process_group"]
    return "the default group" if desc == "default_pg" else f"group {name}" + (
        f" ({desc})" if desc not in ("", "undefined") else "")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
