"""The speed scripts, run small: scripts/bench.py's table and JSON, and scripts/gpu_check.py's non-CUDA parts on gloo.
Shape only: what they measure on a shared CPU says nothing here."""



from tests.helpers.support import REPO


def test_gpu_check_sh_is_strict_and_installs_nothing():
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert "set -euo pipefail" in text and "pip install" not in text and "pip3 install" not in text
    assert "scripts/gpu_check.py --device cuda" in text
