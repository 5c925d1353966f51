"""Bad input: one line on stderr naming the field, the value and the fix; exit code 2; no traceback."""


from tests.helpers.processes import EVENT_S
from tests.helpers.support import distrib


def test_unknown_key_through_the_real_entry_point(tmp_path):
    """The console entry: exit code 2 and one line, also when a config file is wrong."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = -3\n")
    result = distrib("train", "--config", str(bad), timeout=EVENT_S)
    assert result.returncode == 2
    assert result.stderr.strip() == ("distrib: error: train.lr = -3.0: must be a finite number > 0; "
                                     "e.g. --set train.lr=0.01")
