"""The Python API: `from distrib import fit` with a module or a function, datasets or tensors, a Config or a TOML
path, dict overrides and a loss function; `import distrib` stays light; the docstring example and the complete
scripts in scripts/examples run."""

import doctest
import sys

import pytest

from distrib import fit
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, assert_ok, make_image_folder, run


def test_import_distrib_loads_no_torch():
    result = run([sys.executable, "-c", "import sys, distrib; assert 'torch' not in sys.modules, 'torch'; "
                                        "print(sorted(distrib.__all__))"], timeout=EVENT_S)
    assert_ok(result)
    assert result.stdout.strip() == "['Config', 'Preempted', 'fit', 'load_config']"


@pytest.mark.timeout(900)
def test_the_docstring_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it writes runs/fit-doctest
    import distrib.api

    result = doctest.testmod(distrib.api, verbose=False)
    assert result.attempted >= 5 and result.failed == 0
    assert fit is distrib.api.fit


@pytest.mark.timeout(900)
def test_example_imagefolder_classifier(tmp_path):
    make_image_folder(tmp_path / "images", classes=("cat", "dog", "owl"), per_class=(8, 4))
    result = run([sys.executable, str(REPO / "scripts" / "examples" / "imagefolder_classifier.py"),
                  str(tmp_path / "images"), "--image-size", "16", "--max-steps", "2", "--batch", "8", "--workers", "0",
                  "--run-dir", str(tmp_path / "run")], timeout=EVENT_S)
    assert_ok(result)
    assert "test accuracy" in result.stdout and "over 12 images" in result.stdout and "owl" in result.stdout


@pytest.mark.timeout(900)
def test_example_custom_dataset_model(tmp_path):
    result = run([sys.executable, str(REPO / "scripts" / "examples" / "custom_dataset_model.py"), "--steps", "20",
                  "--run-dir", str(tmp_path / "run")], timeout=EVENT_S)
    assert_ok(result)
    assert "test accuracy" in result.stdout and (tmp_path / "run" / "model.pt").is_file()
