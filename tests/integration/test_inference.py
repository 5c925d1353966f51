"""Using a trained model: `distrib eval` gives exactly the run's final test metrics at world sizes 1 and 2 and touches
no other file; `distrib predict` writes one line per input in input order; model.json and the plain-PyTorch load of
docs/using-a-model.md reproduce the predictions; user mistakes are one line, exit 2."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from distrib import cli
from distrib.config import load_config
from distrib.data import load_splits
from tests.helpers.support import REPO, SMALL, assert_ok, distrib, sets

NUM_CLASSES = 4  # <= 5: top-k holds every class, so its probabilities sum to 1
TRAIN = (*SMALL, "data.synthetic_test_size=203", f"data.num_classes={NUM_CLASSES}", "data.eval_batch_size=50",
         "train.max_steps=12", "train.log_every=6", "train.eval_every_epochs=0", "checkpoint.every_steps=6")
METRICS = ("test_loss", "test_accuracy", "test_count")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 12-step run (203 test samples in 5 evaluation batches: 2 ranks get uneven shares)."""
    run = tmp_path_factory.mktemp("inference") / "run"
    assert_ok(distrib("train", *sets(*TRAIN, f"run.dir={run}")))
    return run


def _hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_eval_gives_the_runs_final_metrics_and_touches_nothing_else(run_dir, tmp_path):
    before = _hashes(run_dir)
    expected = {k: v for k, v in _summary(run_dir).items() if k.startswith("test_")}
    assert set(METRICS) <= expected.keys()
    for nproc in (1, 2):
        (run_dir / "eval.json").unlink(missing_ok=True)
        if nproc == 1:
            assert cli.main(["eval", str(run_dir)]) == 0  # in this process: one process, no launcher
        else:
            assert_ok(distrib("eval", str(run_dir), "--nproc-per-node", "2"))
        got = json.loads((run_dir / "eval.json").read_text())
        assert got["world_size"] == nproc and got["source"] == str(run_dir) and got["step"] == 12
        assert {k: got[k] for k in expected} == expected  # exactly, not approximately
    after = _hashes(run_dir)
    eval_hash = after.pop("eval.json")
    assert after == before  # summary, config, metrics, model, checkpoints: byte-identical

    # The final checkpoint holds the same weights; its config comes from inside it. eval.json goes beside it.
    checkpoint = run_dir / "checkpoints" / "step_00000012.pt"
    assert cli.main(["eval", str(checkpoint)]) == 0
    got = json.loads((checkpoint.parent / "eval.json").read_text())
    assert got["step"] == 12 and {k: got[k] for k in expected} == expected
    (checkpoint.parent / "eval.json").unlink()
    assert _hashes(run_dir) == {**before, "eval.json": eval_hash}

    # Any file in the checkpoint format is read by its content, not its name (best_*.pt of a keep-best run).
    best = tmp_path / "best_00000012.pt"
    shutil.copyfile(checkpoint, best)
    assert cli.main(["eval", str(best), "--set", "dist.device=cpu"]) == 0
    assert {k: json.loads((tmp_path / "eval.json").read_text())[k] for k in expected} == expected


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predict_test_split_in_input_order_at_world_size_2(run_dir, tmp_path):
    out = tmp_path / "test.jsonl"
    assert_ok(distrib("predict", str(run_dir), "--input", "test", "--out", str(out), "--nproc-per-node", "2"))
    lines = _lines(out)
    assert [line["source"] for line in lines] == [f"test:{i}" for i in range(203)]
    # Each line's target is sample i's true label: rank 1's lines were gathered after rank 0's, in order.
    _, test = load_splits(load_config(str(run_dir / "config.toml")).data, None)
    assert [line["target"] for line in lines] == test.targets.tolist()
    summary = _summary(run_dir)
    assert sum(line["label"] == line["target"] for line in lines) / 203 == summary["test_accuracy"]
    card = json.loads((run_dir / "model.json").read_text())
    for line in lines:
        top = line["top_k"]
        assert len(top) == NUM_CLASSES and line["label"] == top[0]["label"]
        assert line["class_name"] == card["data"]["class_names"][line["label"]]
        probs = [entry["probability"] for entry in top]
        assert probs == sorted(probs, reverse=True) and abs(sum(probs) - 1) < 1e-5


def _image_folder(root: Path, count: int) -> list[Path]:
    g = torch.Generator().manual_seed(7)
    paths = []
    for i in range(count):
        path = root / f"class_{i % 2}" / f"img_{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = torch.randint(0, 256, (28, 28), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy(), mode="L").save(path)
        paths.append(path)
    (root / "notes.txt").write_text("not an image")
    return sorted(paths)


def _docs_snippet(run: Path) -> str:
    """The five-line plain-PyTorch load of docs/using-a-model.md, model.json."""
    text = (REPO / "docs" / "using-a-model.md").read_text()
    section = text[text.index("## model.json"):]
    code = re.search(r"```python[^\n]*\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) == 5
    return code.replace("runs/default", str(run))


def test_predict_folder_and_the_docs_load_agree(run_dir, tmp_path):
    paths = _image_folder(tmp_path / "images", 7)
    out = tmp_path / "folder.jsonl"
    assert cli.main(["predict", str(run_dir), "--input", str(tmp_path / "images"), "--out", str(out)]) == 0
    lines = _lines(out)
    assert [line["source"] for line in lines] == [str(p) for p in paths]  # one line per image, sorted, no notes.txt

    card = json.loads((run_dir / "model.json").read_text())
    assert card["data"]["input_shape"] == [1, 28, 28] and card["data"]["num_classes"] == NUM_CLASSES
    assert len(card["data"]["class_names"]) == NUM_CLASSES and card["model"]["factory"]
    scope: dict = {}
    exec(_docs_snippet(run_dir), scope)  # the docs' five lines, as a user runs them
    model = scope["model"]
    mean, std = (torch.tensor(card["data"][k]).view(-1, 1, 1) for k in ("mean", "std"))
    images = torch.stack([torch.from_numpy(np.array(Image.open(p))).float()[None] / 255 for p in paths])
    with torch.no_grad():
        probs = model((images - mean) / std).softmax(dim=1)
    for line, row in zip(lines, probs):
        assert line["label"] == int(row.argmax())
        for entry in line["top_k"]:
            assert abs(entry["probability"] - float(row[entry["label"]])) < 1e-5
        assert abs(sum(entry["probability"] for entry in line["top_k"]) - 1) < 1e-5


def _fails(capsys, *argv) -> str:
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    last = err.splitlines()[-1]  # log lines (the data loaded) may come first; the error is one line, at the end
    assert last.startswith("distrib: error: ") and err.count("distrib: error") == 1 and "Traceback" not in err, err
    return last


def test_user_mistakes_are_one_line_exit_2(capsys, run_dir, tmp_path):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert "no model.pt" in _fails(capsys, "eval", str(empty))
    garbage = tmp_path / "step_00000001.pt"
    garbage.write_bytes(b"not a checkpoint")
    assert str(garbage) in _fails(capsys, "eval", str(garbage))
    assert "no such run directory or checkpoint" in _fails(capsys, "eval", str(tmp_path / "missing"))
    missing = tmp_path / "no_such_folder"
    assert "--input" in _fails(capsys, "predict", str(run_dir), "--input", str(missing), "--out", str(tmp_path / "o"))
    no_images = tmp_path / "no_images"
    no_images.mkdir()
    (no_images / "readme.txt").write_text("text")
    assert "no image files" in _fails(capsys, "predict", str(run_dir), "--input", str(no_images), "--out",
                                 str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    other_data = _fails(capsys, "eval", str(run_dir), "--set", "data.num_classes=3")
    assert "other data than the model was trained on" in other_data and "num_classes 4 -> 3" in other_data
    newest = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]  # a checkpoint records its data too
    other_data = _fails(capsys, "eval", str(newest), "--set", "data.num_classes=3")
    assert "other data than the model was trained on" in other_data and "num_classes 4 -> 3" in other_data
