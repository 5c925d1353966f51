"""`distrib plot RUN_DIR`: a readable PNG of loss, test accuracy and throughput against the step."""

import json
import sys

import pytest

from distrib import cli
from distrib.errors import UserError
from distrib.metrics.plot import make_figure, plot_run, read_records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, num_steps=6):
    records = []
    for step in range(1, num_steps + 1):
        records.append({"step": step * 10, "epoch": step // 3, "loss": 2.0 / step, "lr": 0.05,
                        "samples_per_second": 1000.0 + step, "samples_per_second_per_device": 500.0 + step / 2,
                        "step_time_p50_s": 0.1, "step_time_p95_s": 0.2, "data_wait_share": 0.1, "mfu": 0.01})
        if step % 3 == 0:
            records.append({"step": step * 10, "epoch": step // 3, "test_loss": 1.0 / step,
                            "test_accuracy": 0.5 + step / 20, "test_count": 100})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_figure_has_the_expected_axes_and_curves(tmp_path):
    _write_metrics(tmp_path)
    figure = make_figure(read_records(tmp_path))
    axes = figure.get_axes()
    assert [a.get_title() for a in axes] == ["Loss", "Test accuracy", "Throughput"]
    assert [[line.get_label() for line in a.get_lines()] for a in axes] == [
        ["train loss", "test loss"], ["test accuracy"], ["samples/s (all devices)"]]
    train_loss = axes[0].get_lines()[0]
    assert list(train_loss.get_xdata()) == [10, 20, 30, 40, 50, 60] and train_loss.get_ydata()[0] == 2.0
    assert list(axes[1].get_lines()[0].get_xdata()) == [30, 60]
    assert list(axes[1].get_lines()[0].get_ydata()) == pytest.approx([65.0, 80.0])  # in percent
    assert axes[2].get_xlabel() == "optimizer step"


def test_distrib_plot_writes_a_png(tmp_path, capsys):
    _write_metrics(tmp_path)
    assert cli.main(["plot", str(tmp_path)]) == 0
    path = tmp_path / "curves.png"
    assert capsys.readouterr().out.strip() == str(path)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # the IHDR chunk
    assert (width, height) == (700, 900)
    assert plot_run(tmp_path, tmp_path / "other.png").read_bytes().startswith(PNG_SIGNATURE)


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == (f"distrib: error: {tmp_path / 'missing' / 'metrics.jsonl'}: no such "
                                               "file; give the run.dir of a run that has logged at least one step")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not a JSON line"):
        read_records(tmp_path)
    _write_metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "distrib: error: distrib plot needs matplotlib; pip install 'distrib[plot]'"


def test_a_regression_run_gets_no_empty_accuracy_panel(tmp_path):
    _write_metrics(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [{key: value for key, value in json.loads(line).items() if key != "test_accuracy"} for line in lines]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    axes = make_figure(read_records(tmp_path)).get_axes()
    assert [a.get_title() for a in axes] == ["Loss", "Throughput"]
    assert all(line.get_xdata().size for a in axes for line in a.get_lines())
    assert axes[-1].get_xlabel() == "optimizer step"
