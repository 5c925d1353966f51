"""Hang dumps: distrib's comparison of the ranks' flight-recorder traces, on hand-built dumps of the shape torch 2.14
writes (torch's fr_trace fails on gloo's), and a rank's watch writing its trace once and asking the others too."""

import pickle
import time
from pathlib import Path

import torch.distributed as dist

from distrib.distributed import hang
from distrib.distributed.hang import HangWatch
from distrib.errors import EXIT_HUNG
from distrib.launch.hang_traces import divergence, read_traces
from distrib.launch.reporting import hang_line

SECOND = 10**9
DEFAULT = ("0", "default_pg")


def _entry(seq: int, op: str = "all_reduce", created_s: float = 0.0, group=DEFAULT, p2p: bool = False) -> dict:
    return {"process_group": group, "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0,
            "profiling_name": f"gloo:{op}", "time_created_ns": int((100 + created_s) * SECOND), "is_p2p": p2p,
            "retired": True, "state": "scheduled"}


def _trace(*entries: dict, dumped_s: float = 130.0, stopped_s: float = 0.0, stopped_since_s: float | None = None) \
        -> dict:
    groups = {entry["process_group"][0] for entry in entries} | {"0"}
    since = None if stopped_since_s is None else int((100 + stopped_since_s) * SECOND)
    return {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0]"}},
            "pg_status": {group: {"last_enqueued_collective": 0, "last_completed_collective": 0} for group in groups},
            "entries": list(entries),
            "distrib": {"rank": 0, "dumped_ns": int((100 + dumped_s) * SECOND), "reason": "timeout",
                        "stopped_s": stopped_s, "stopped_since_ns": since}}


def _steps(last: int, op_last: str = "all_reduce") -> list[dict]:
    return [_entry(seq, "broadcast" if seq == 1 else op_last if seq == last else "all_reduce", created_s=seq)
            for seq in range(1, last + 1)]


def test_the_rank_that_did_not_enter_the_collective_is_named_with_the_last_common_sequence():
    traces = {rank: _trace(*_steps(7)) for rank in (0, 2, 3)}
    traces[1] = _trace(*_steps(6), dumped_s=160.0, stopped_s=26.04)
    traces[1]["distrib"]["main_stack"] = [("/work/train.py", 80, "main"), ("/work/model.py", 49, "forward")]
    assert divergence(traces, 4) == ("rank 1 did not enter all_reduce #7 of the default group (ranks 0, 2, 3 entered "
                                     "it; last common sequence 6); rank 1 did not run for 26.04 s (stopped)")
    traces[1]["distrib"]["stopped_s"] = 0.0  # hung in its own code: its watch saw where, as it was then
    assert divergence(traces, 4).endswith("last common sequence 6); rank 1 was in forward (model.py:49)")


def test_collectives_after_the_first_dump_are_left_out():
    """A rank that went on after the others gave up enters the collective they waited in: not a common one."""
    traces = {0: _trace(*_steps(7), dumped_s=130.0), 1: _trace(*_steps(6), _entry(7, created_s=150), dumped_s=151.0)}
    assert divergence(traces) == ("rank 1 did not enter all_reduce #7 of the default group (rank 0 entered it; last "
                                  "common sequence 6); rank 1's trace also lists all_reduce #7 of the default group, "
                                  "entered after the first rank dumped")


def test_ranks_stopped_inside_the_last_collective_and_ranks_without_a_trace():
    """Only the ranks that left a trace are said to have entered the last collective."""
    traces = {0: _trace(*_steps(5)), 1: _trace(*_steps(5), stopped_s=30.0), 2: _trace(*_steps(5), stopped_s=1.5)}
    assert divergence(traces, 4) == ("ranks 0, 1, 2 entered all_reduce #5 of the default group, the last collective, "
                                     "and none went past it; rank 1 did not run for 30 s (stopped); no trace from "
                                     "rank 3")
    traces[3] = _trace(*_steps(5))
    assert divergence(traces, 4).startswith("every rank entered all_reduce #5 of the default group, the last ")


def test_a_stopped_rank_is_compared_as_it_was_when_it_stopped_even_when_the_others_dumped_late():
    """World 4: rank 1 stopped at 6.5 s (after #6); ranks 0, 2, 3 entered #7 at 7 s but dumped only at 40 s, after
    rank 1 ran again (at 24 s) and entered #7 too. Its trace says when it had stopped by: #7 is not a common
    collective, and the line says where that #7 of its trace comes from."""
    traces = {rank: _trace(*_steps(7), dumped_s=40.0) for rank in (0, 2, 3)}
    traces[1] = _trace(*_steps(6), _entry(7, created_s=24.0), dumped_s=40.2, stopped_s=17.5, stopped_since_s=7.0)
    assert divergence(traces, 4) == (
        "rank 1 did not enter all_reduce #7 of the default group (ranks 0, 2, 3 entered it; last common sequence 6); "
        "rank 1 did not run for 17.5 s (stopped); rank 1's trace, dumped once it ran again, also lists all_reduce #7 "
        "of the default group, which it entered then")


def test_a_trace_dumped_after_the_stopped_rank_ran_again_says_so():
    """World 2: rank 0 dumped at 27 s; rank 1, stopped since 6.5 s, ran again at 31 s and entered #7 and #8 before
    its own dump: its trace lists them, and the line says it entered them only then."""
    traces = {0: _trace(*_steps(7), dumped_s=27.0),
              1: _trace(*_steps(6), _entry(7, created_s=31.0), _entry(8, created_s=31.1), dumped_s=31.2,
                        stopped_s=24.0, stopped_since_s=7.0)}
    assert divergence(traces, 2) == (
        "rank 1 did not enter all_reduce #7 of the default group (rank 0 entered it; last common sequence 6); rank 1 "
        "did not run for 24 s (stopped); rank 1's trace, dumped once it ran again, also lists all_reduce #7 of the "
        "default group and 1 more, which it entered then")


def test_the_first_divergence_in_time_wins_and_other_groups_are_named():
    shard = ("3", "mesh_shard")
    late = _entry(8, created_s=20)
    early = _entry(2, "reduce_scatter", created_s=12, group=shard)
    traces = {0: _trace(*_steps(7), late, _entry(1, created_s=11, group=shard), early),
              1: _trace(*_steps(7), _entry(1, created_s=11, group=shard))}
    assert divergence(traces) == ("rank 1 did not enter reduce_scatter #2 of group 3 (mesh_shard) (rank 0 entered it; "
                                  "last common sequence 1)")


def test_different_collectives_at_one_sequence_number_and_point_to_point_left_out():
    traces = {0: _trace(*_steps(4, op_last="broadcast"), _entry(9, "send", p2p=True)),
              1: _trace(*_steps(4)), 2: _trace(*_steps(4))}
    assert divergence(traces) == ("the ranks ran different collectives as #4 of the default group: ranks 1, 2 "
                                  "all_reduce; rank 0 broadcast")


def test_torchs_own_dumps_compare_without_a_cutoff(tmp_path):
    for rank, last in ((0, 9), (1, 8)):
        trace = _trace(*_steps(last))
        del trace["distrib"]
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(trace))  # torch names them rank_N, without .trace
    (tmp_path / "rank_x.trace").write_bytes(b"not a trace")
    traces = read_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    assert divergence(traces, 2).startswith("rank 1 did not enter all_reduce #9 ")
    assert read_traces(tmp_path, since_ns=time.time_ns() + 60 * SECOND) == {}  # an earlier run's are left out


def test_a_watch_dumps_once_asks_the_others_and_tells_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setattr(hang, "TICK_S", 0.05)
    store, note = dist.HashStore(), tmp_path / "hang_note"
    first = HangWatch(lambda: store, 0, 60.0, tmp_path / "hang", note=note)
    first.failed("lost")  # a peer that died: no dump while no rank dumped
    assert not first.dumped and not (tmp_path / "hang").exists()
    first.failed("timeout")
    first.dump("lost")  # once: the first dump is the one that tells
    trace = pickle.loads((tmp_path / "hang" / "rank_0.trace").read_bytes())
    assert trace["distrib"]["reason"] == "timeout" and {"entries", "pg_status"} <= set(trace)
    other = HangWatch(lambda: store, 1, 60.0, tmp_path / "hang").start()
    try:
        deadline = time.monotonic() + 30
        while not other.dumped and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        other.stop()
    assert pickle.loads((tmp_path / "hang" / "rank_1.trace").read_bytes())["distrib"]["reason"] == "asked"
    assert note.read_text() == str(tmp_path / "hang")
    line = hang_line(note, 0, 2)
    assert line.startswith("distrib launch: hang: ") and line.endswith(f"every rank's trace: {tmp_path / 'hang'}")
    assert hang_line(tmp_path / "no_note", 0, 2) is None


def test_a_collective_in_flight_for_longer_than_the_timeout_is_a_hang(monkeypatch):
    """The watch's own check, on the status torch's recorder gives: the same collective in flight past timeout_s."""
    status = {"0": {"last_enqueued_collective": 5, "last_completed_collective": 4}}
    monkeypatch.setattr(hang, "dump_fr_trace", lambda includeCollectives=True: pickle.dumps({"pg_status": status}))
    watch = HangWatch(dist.HashStore, 0, timeout_s=10.0, directory=Path("unused"))
    assert not watch._outwaited(100.0)  # first seen in flight
    assert not watch._outwaited(109.0)
    status["0"] = {"last_enqueued_collective": 6, "last_completed_collective": 5}  # it finished, the next is in flight
    assert not watch._outwaited(111.0)
    assert watch._outwaited(121.5)
    status["0"] = {"last_enqueued_collective": 6, "last_completed_collective": 6}  # all done: nothing in flight
    assert not watch._outwaited(200.0) and watch._in_flight == {}


def test_a_stopped_rank_that_another_rank_dumped_before_ends_once_dumped(tmp_path, monkeypatch, capfd):
    """A rank whose watch did not run for 30 s (SIGSTOP), asked to dump: it writes its trace, with the time its stop
    had begun by, and ends with EXIT_HUNG and one line, instead of running on into the collective the others left.
    A rank that was not stopped only dumps."""
    def exits(code):
        raise SystemExit(code)
    monkeypatch.setattr(hang.os, "_exit", exits)
    store = dist.HashStore()
    store.set(hang.DUMP_KEY, "0")
    running = HangWatch(lambda: store, 2, 20.0, tmp_path)
    running.dump("asked")
    assert pickle.loads((tmp_path / "rank_2.trace").read_bytes())["distrib"]["stopped_since_ns"] is None
    stopped = HangWatch(lambda: store, 1, 20.0, tmp_path)
    stopped._last_tick -= 31.0  # its last tick before the stop
    stopped._last_tick_ns -= 31 * SECOND
    try:
        stopped.dump("asked")
        raise AssertionError("the stopped rank did not end")
    except SystemExit as e:
        assert e.code == EXIT_HUNG
    trace = pickle.loads((tmp_path / "rank_1.trace").read_bytes())["distrib"]
    assert trace["stopped_s"] >= 29.9
    assert abs(trace["stopped_since_ns"] - (time.time_ns() - 30 * SECOND)) < 2 * SECOND
    assert capfd.readouterr().err.startswith("distrib: error: rank 1 did not run for 30.0 s (stopped: ")
