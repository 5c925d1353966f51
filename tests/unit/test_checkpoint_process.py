"""checkpoint.async_save: its values (true is the checkpoint process), and a fit() script that cannot start a
checkpoint process (no main guard: the process would run the script's top level again) saving in a thread instead,
with one line that names the guard."""

import sys
import types

import pytest

from distrib import api
from distrib.checkpoint.process import GUARD, unguarded_script
from distrib.config import load_config
from distrib.errors import ConfigError, UserError


@pytest.mark.parametrize("given, meant", [("true", "process"), ("false", "off"), ("thread", "thread"),
                                          ("process", "process"), ("off", "off")])
def test_async_save_takes_a_mode_and_the_old_true_and_false(given, meant):
    assert load_config(None, [f"checkpoint.async_save={given}"]).checkpoint.async_save == meant


def test_an_unknown_mode_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match="checkpoint.async_save = 'processes': must be one of off, thread, process"):
        load_config(None, ["checkpoint.async_save=processes"])


SCRIPT = '''import os
top = check()


def main():
    return check()


called = main()
if __name__ == "__main__":
    guarded = check()
    inside = main()
else:
    other = check()
'''


def _run_as_main(tmp_path, monkeypatch, check, name: str = "__main__") -> dict:
    """SCRIPT run as the __main__ module from a file, with check() at its top level and inside functions."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    main = types.ModuleType(name)
    main.__file__, main.check = str(path), check
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(SCRIPT, str(path), "exec"), vars(main))
    return vars(main)


def test_a_call_outside_the_main_guard_is_found_from_any_depth(tmp_path, monkeypatch):
    found = _run_as_main(tmp_path, monkeypatch, unguarded_script)
    script = str(tmp_path / "train.py")
    assert found["top"] == found["called"] == script  # at the top level, and in a function called from there
    assert found["guarded"] is None and found["inside"] is None
    # the guard's else: what a process started with spawn runs
    assert _run_as_main(tmp_path, monkeypatch, unguarded_script, name="__mp_main__")["other"] == script


def test_a_call_from_no_top_level_code_of_the_script_says_nothing(tmp_path, monkeypatch):
    main = types.ModuleType("__main__")
    main.__file__ = str(tmp_path / "train.py")
    (tmp_path / "train.py").write_text("check()\n")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert unguarded_script() is None  # called from this test, not from the script (a prompt, a notebook)


def test_fit_from_an_unguarded_script_saves_in_a_thread_and_says_why(tmp_path, monkeypatch, capsys):
    config = load_config(None, ["checkpoint.async_save=process", "dist.strategy=fsdp"])
    found = _run_as_main(tmp_path, monkeypatch, lambda: api._without_spawn_if_unguarded(config))
    assert found["top"].checkpoint.async_save == "thread" and found["guarded"].checkpoint.async_save == "process"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2  # top and called: one line each time fit() is called unguarded
    assert said[0] == (f"distrib.fit: warning: checkpoint.async_save = 'process' starts a checkpoint process that runs "
                       f"{tmp_path / 'train.py'}'s top level again, and fit() is called there outside `{GUARD}`; "
                       "saving in a thread instead (checkpoint.async_save = 'thread'): put the call under that guard "
                       "to save in a process")


def test_fit_in_a_process_that_reruns_the_script_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__mp_main__"))
    with pytest.raises(UserError, match=r"distrib.fit: called in a process that this script's run started .* put the "
                                        r"training under `if __name__ == \"__main__\":`"):
        api._without_spawn_if_unguarded(load_config(None, []))


class _Dead:
    """A checkpoint process that died (what CheckpointProcess.death says), for the ranks' agreement in one process."""

    def death(self, wait_s: float = 0.0) -> str:
        return "rank 0's checkpoint process (pid 4242, killed by SIGKILL)"

    def close(self) -> None:
        pass


def test_a_checkpoint_process_dead_with_a_write_is_agreed_on_and_only_the_last_write_stops_the_run():
    """A write lost with its checkpoint process: before the next save it is only noted (that save is then written
    blocking, and new processes started: tests/integration/test_fsdp.py); lost at the end of the run (close), it is
    an EnvironmentFault, exit 74, saying what died, not a user's mistake (2)."""
    from concurrent.futures import Future

    from distrib.checkpoint.sharded import ShardedStorage, _Write
    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime
    from distrib.errors import EnvironmentFault

    def lost(name: str) -> _Write:
        future = Future()
        future.set_exception(BrokenPipeError(32, "Broken pipe"))
        return _Write(future, None, name)

    with open_runtime(DistConfig(device="cpu")) as runtime:
        storage = ShardedStorage(runtime, async_save="process")
        storage.process, storage.stager = _Dead(), _Dead()
        storage.pending = lost("step_00000004")
        storage.wait()
        assert storage.died == ("rank 0's checkpoint process (pid 4242, killed by SIGKILL) died, and the write of "
                                "step_00000004 with it")
        storage.died, storage.pending = None, lost("step_00000006")
        with pytest.raises(EnvironmentFault) as info:
            storage.close()
    assert info.value.exit_code == 74 and str(info.value) == (
        "checkpoint.async_save = process: rank 0's checkpoint process (pid 4242, killed by SIGKILL) died, and the "
        "write of step_00000006 with it; the run's last checkpoint is lost, the one before is intact: run the same "
        "command again to resume there")
