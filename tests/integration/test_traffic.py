"""distrib plan's bytes per collective per step, by mesh dimension and kind, against those a real run's process groups
carry: scripts/bench_traffic.py at its smallest (one torchrun launch of 8 workers, 2 steps of a tiny GPT at pp 2 x
fsdp 2 x tp 2, then of a tiny MoE at fsdp 8 (ep 2)). Its full matrix (fsdp, hsdp, ddp, tp, pp, ep, replica groups)
is the bench's."""

import json
import sys

import pytest

from tests.helpers.processes import EVENT_S, REPO, run

# what each layout's step must carry, by (mesh dimension, kind): every degree of the layout
EXPECTED = {"pp_tp": {("pp", "send"), ("tp", "all-reduce"), ("shard", "all-gather"), ("shard", "reduce-scatter")},
            "ep": {("ep", "all-to-all"), ("shard_mod_ep+ep", "all-gather"), ("shard_mod_ep+ep", "reduce-scatter"),
                   ("shard_mod_ep", "all-gather"), ("shard_mod_ep", "reduce-scatter")}}


@pytest.mark.timeout(900)
def test_the_plans_collectives_are_within_10_percent_of_the_bytes_counted_in_a_run(tmp_path):
    out = tmp_path / "traffic.json"
    result = run([sys.executable, str(REPO / "scripts" / "bench_traffic.py"), "--layouts", ",".join(EXPECTED),
                  "--json", str(out)], timeout=EVENT_S)
    rows = json.loads(out.read_text()) if out.exists() else {}
    assert set(rows) == set(EXPECTED), result.stderr
    for name, expected in EXPECTED.items():
        assert f"== {name} ==" in result.stdout
        carried = {(row["dimension"], row["kind"]): row for row in rows[name]}
        assert expected <= set(carried), (name, sorted(carried))
        for key in expected:  # counted exactly (the experts' all-to-all: each rank's rows as routed, mean of ranks)
            row = carried[key]
            assert row["counted"] > 0 and row["ratio"] == pytest.approx(1, abs=0.10), (name, row)
            assert f"{row['ratio']:.3f}" in result.stdout
        # anything else a step carries is a few scalars (the loss, the gradients' norm), not a missed collective
        assert all(row["counted"] < 1024 for key, row in carried.items() if key not in expected), (name, carried)
    assert result.returncode == 0, result.stdout + result.stderr
