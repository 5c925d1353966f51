"""A run owns its folders: one live run per run.dir and checkpoint.dir (a lock naming its holder), checkpoints that
carry their run's id, pruning that never deletes another run's files, and no silent take-over of another run's."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrib import cli
from distrib.checkpoint.folder import step_of
from distrib.checkpoint.format import list_checkpoints, run_id_of
from distrib.config import load_config
from distrib.launch.rundir import LOCK_NAME, FolderBusyError, lock_folder
from distrib.worker import run_training
from tests.helpers.processes import EVENT_S, wait_for
from tests.helpers.support import REPO, kill_tree, snapshot

BASE = ["data.name=synthetic", "data.synthetic_train_size=512", "data.synthetic_test_size=64", "run.progress=false",
        "train.global_batch_size=32", "train.schedule=constant", "train.warmup_steps=2", "train.log_every=4",
        "train.eval_every_epochs=0", "dist.device=cpu"]


def _sets(*overrides):
    return [a for o in [*BASE, *overrides] for a in ("--set", o)]


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    fd = lock_folder("run.dir", tmp_path)
    try:
        with pytest.raises(FolderBusyError) as info:
            lock_folder("run.dir", tmp_path)  # another open file: refused like another process
        message = str(info.value)
        assert f"run.dir = '{tmp_path}': in use by another run (host {socket.gethostname()}, pid {os.getpid()}, " \
               "since 20" in message and "--set run.dir=" in message
    finally:
        os.close(fd)
    # A holder killed with SIGKILL leaves no stale lock: the kernel drops it with the process.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from distrib.launch.rundir import lock_folder; "
                               f"lock_folder('run.dir', {str(tmp_path)!r}); print('locked', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderBusyError, match=f"pid {holder.pid},"):
            lock_folder("run.dir", tmp_path)
        holder.kill()
        holder.wait(timeout=30)
        os.close(lock_folder("run.dir", tmp_path))
    finally:
        kill_tree(holder)


@pytest.mark.timeout(900)
def test_two_runs_started_together_on_one_run_dir_one_trains_the_other_is_refused_in_seconds(tmp_path):
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "distrib", "train", *_sets(f"run.dir={tmp_path}",
                               "train.max_steps=40", "checkpoint.every_steps=10")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              start_new_session=True) for _ in range(2)]
    lock = tmp_path / LOCK_NAME
    try:
        def holding():  # whichever took the lock is stopped there, so that it still holds it below
            text = lock.read_text() if lock.exists() else ""
            return next((p for p in procs if f"pid {p.pid}," in text), None)
        holder = wait_for(holding, EVENT_S, "run holding the lock", procs)
        os.kill(holder.pid, signal.SIGSTOP)
        locked = time.monotonic()
        other = procs[1 - procs.index(holder)]
        _, other_err = other.communicate(timeout=EVENT_S)
        # Both started together and do the same work up to the lock: the other one is refused once it gets there,
        # within the time the holder took to get there (importing torch alone can take 10 s on a loaded machine).
        elapsed, holder_start = time.monotonic() - locked, locked - started
        os.kill(holder.pid, signal.SIGCONT)
        out, err = holder.communicate(timeout=EVENT_S)
    finally:
        for proc in procs:
            kill_tree(proc)
    assert other.returncode == 2 and elapsed < max(10.0, holder_start), (other.returncode, elapsed, holder_start,
                                                                         other_err)
    since = lock.read_text().split("since ")[1].strip()
    assert other_err.strip().splitlines()[-1] == (
        f"distrib: error: run.dir = '{tmp_path}': in use by another run (host {socket.gethostname()}, "
        f"pid {holder.pid}, since {since}); wait for it to end, stop it, or give this run another folder: "
        "--set run.dir=ANOTHER_FOLDER")
    assert "Traceback" not in other_err and other_err.count("distrib: error") == 1, other_err
    assert holder.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 40 and json.loads((tmp_path / "summary.json").read_text())


def _train(run_dir, *overrides) -> dict:
    return run_training(load_config(None, [*BASE, f"run.dir={run_dir}", *overrides]))


def _cli(capsys, run_dir, *overrides) -> tuple[int, str]:
    code = cli.main(["train", *_sets(f"run.dir={run_dir}", *overrides)])
    return code, capsys.readouterr().err.strip()


@pytest.fixture(scope="module")
def older_run(tmp_path_factory) -> Path:
    """A finished run whose checkpoints (30, 40) are numbered above anything the new runs below reach."""
    run_dir = tmp_path_factory.mktemp("older")
    _train(run_dir, "train.max_steps=40", "checkpoint.every_steps=10")
    return run_dir


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["resume=never", "junk only"])
def test_a_new_run_beside_another_runs_checkpoints_is_refused_and_touches_nothing(capsys, tmp_path, older_run,
                                                                                   case):
    if case == "junk only":  # resume=auto finds only a damaged file: said so, and still not this run's to prune
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "step_99999999.pt").write_bytes(b"junk")
        overrides = ["checkpoint.resume=auto"]
        said = ("nothing to resume, its 1 checkpoint(s) that could continue the run are damaged (the newest: "
                "checkpoint", "step_99999999.pt: unreadable", "restore them", "checkpoint.resume=never")
    else:
        shutil.copytree(older_run, tmp_path, dirs_exist_ok=True)
        overrides = ["checkpoint.resume=never"]
        said = ("newest step_00000040.pt", "checkpoint.resume=auto", "move them away", "new --set run.dir",
                "checkpoint.foreign=keep")
    before = snapshot(tmp_path)
    code, err = _cli(capsys, tmp_path, "train.max_steps=12", "checkpoint.every_steps=4", *overrides)
    err = err.splitlines()[-1]  # after the run's info lines, one line and no traceback
    assert code == 2 and err.startswith("distrib: error: checkpoint.dir = ") and "Traceback" not in err, err
    for text in said:
        assert text in err, err
    assert snapshot(tmp_path) == before  # every earlier file byte for byte, and no new one (but the lock)


@pytest.mark.timeout(900)
def test_told_to_keep_them_a_new_run_prunes_only_its_own_and_sigterm_names_a_checkpoint_that_exists(tmp_path,
                                                                                                    older_run):
    shutil.copytree(older_run, tmp_path, dirs_exist_ok=True)
    theirs = {name: data for name, data in snapshot(tmp_path).items() if name.startswith("checkpoints/step_")}
    their_id = run_id_of(tmp_path / "checkpoints" / "step_00000040.pt")
    # The worker sends itself SIGTERM in step 14, after checkpoint 12: at an exact step on any machine (on a quiet
    # one, a SIGTERM sent from here once checkpoint 12 showed up came after step 40, where the other run's is).
    dying = "model.factory=tests.helpers.dying_model:network"
    cmd = [sys.executable, "-m", "distrib", "train", *_sets(f"run.dir={tmp_path}", "checkpoint.resume=never",
                                                             "checkpoint.foreign=keep", "train.epochs=0",
                                                             "train.max_steps=100000",
                                                             "checkpoint.every_steps=4", dying)]
    env = {**os.environ, "DISTRIB_TEST_DIE_AT": "14", "DISTRIB_TEST_DIE_RANK": "0",
           "DISTRIB_TEST_DIE_SIGNAL": "SIGTERM"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=EVENT_S)
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, out[-3000:]
    named = Path(re.search(r"checkpoint (\S+\.pt)", out).group(1))
    stopped_at, our_id = step_of(named), run_id_of(named)
    assert named.exists() and stopped_at >= 12 and our_id != their_id
    ours = [p for p in list_checkpoints(tmp_path / "checkpoints") if f"checkpoints/{p.name}" not in theirs]
    previous = (stopped_at - 1) // 4 * 4
    # keep_last = 2, named with this run's id beside the other run's
    assert [p.name for p in ours] == [f"step_{s:08d}-{our_id}.pt" for s in (stopped_at, previous)]
    assert {run_id_of(p) for p in ours} == {our_id}
    # resume=auto continues this run (the folder's owner now), not the other run's higher-numbered checkpoint.
    resumed = _train(tmp_path, "train.epochs=0", f"train.max_steps={stopped_at + 4}", "checkpoint.every_steps=4", dying)
    assert resumed["resumed_from_step"] == stopped_at and resumed["steps"] == stopped_at + 4
    assert run_id_of(tmp_path / "checkpoints" / f"step_{stopped_at + 4:08d}-{our_id}.pt") == our_id
    after = snapshot(tmp_path)
    assert {name: after[name] for name in theirs} == theirs  # the other run's checkpoints, byte for byte
