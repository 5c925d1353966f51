"""What identifies a run's data in its checkpoints (distrib.data.identity): a file's fingerprint reads a bounded few
blocks whatever its size and changes with them; the changes a resume reports name the file and what changed; data
from code says its kind, length and, for tensors, a few rows; every source of load_data names its files."""

import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from distrib.config import DataConfig
from distrib.data import identity, idx, load_data
from distrib.data.identity import BLOCK_BYTES, NUM_BLOCKS, data_changes, file_identity
from distrib.data.named import CIFAR_FILES
from distrib.data.tensors import Split
from distrib.distributed.runtime import Runtime
from tests.helpers.support import make_cifar_dir, make_idx_dir, make_image_folder
from tests.helpers.token_shards import learnable_stream, write_llmc_shards

CPU = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def _load(**kwargs):
    return load_data(DataConfig(**kwargs), CPU, seed=0, log=lambda message: None)


def test_a_file_fingerprint_reads_a_bounded_few_blocks_and_changes_with_any_of_them(tmp_path, monkeypatch):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    read = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append(n) or pread(fd, n, offset))
    before = file_identity(big)
    assert before["size"] == 1 << 30 and sum(read) == NUM_BLOCKS * BLOCK_BYTES == 256 * 1024
    step = ((1 << 30) - BLOCK_BYTES) // (NUM_BLOCKS - 1)
    for offset in (0, 7 * step + 100, (1 << 30) - 1):  # the head, a strided block, the last byte
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b"\1")
        after = file_identity(big)
        assert after["size"] == before["size"] and after["hash"] != before["hash"], offset
        before = after
    small = tmp_path / "small.bin"
    small.write_bytes(bytes(1000))
    first = file_identity(small)
    small.write_bytes(bytes(999) + b"\1")  # a small file is hashed whole
    assert file_identity(small)["hash"] != first["hash"]


def test_changed_token_shards_are_named_with_what_changed(tmp_path):
    stream = learnable_stream(4000)
    write_llmc_shards(tmp_path / "a", stream, (1200, 1500))
    files = sorted((tmp_path / "a").glob("*.bin"))
    saved = identity.of_files(files)()
    assert data_changes(saved, identity.of_files(files)()) == []
    shutil.copytree(tmp_path / "a", tmp_path / "moved")  # the same bytes elsewhere: the same data
    moved = sorted((tmp_path / "moved").glob("*.bin"))
    assert data_changes(saved, identity.of_files(moved)()) == []
    write_llmc_shards(tmp_path / "moved", stream, (1200, 1499))  # moved and changed: named where it is now
    assert data_changes(saved, identity.of_files(moved)()) == [
        f"{tmp_path}/moved/shard_train_000001.bin: 4024 -> 4022 bytes",
        f"{tmp_path}/moved/shard_val_000000.bin: 3624 -> 3626 bytes"]

    shard = tmp_path / "a" / "shard_train_000001.bin"
    write_llmc_shards(tmp_path / "a", learnable_stream(4000, seed=1), (1200, 1500))  # same sizes, other tokens
    assert data_changes(saved, identity.of_files(files)()) == [
        f"{tmp_path}/a/shard_train_000000.bin: other content (the same 3424 bytes)",
        f"{shard}: other content (the same 4024 bytes)",
        f"{tmp_path}/a/shard_val_000000.bin: other content (the same 3624 bytes)"]
    write_llmc_shards(tmp_path / "a", stream, (1200, 1000))  # fewer tokens in shard 1, more in the val shard
    assert data_changes(saved, identity.of_files(files)())[:1] == [f"{shard}: 4024 -> 3024 bytes"]
    shard.unlink()
    (tmp_path / "a" / "new.bin").write_bytes(bytes(10))
    now = identity.of_files(sorted((tmp_path / "a").glob("*.bin")))()
    assert data_changes(saved, now) == [f"{shard} is gone", f"{tmp_path}/a/shard_val_000000.bin: 3624 -> 4624 bytes",
                                        f"{tmp_path}/a/new.bin is new"]


class Rows(Dataset):
    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        return torch.zeros(2), 0


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


def test_data_from_code_says_its_kind_length_and_a_few_rows_of_tensors():
    x, y = torch.randn(500, 3), torch.arange(500) % 4
    saved = identity.of_objects(train=Split(x, y), test=Rows(10), val=None)()
    assert saved["objects"]["test"] == {"kind": f"{__name__}.Rows", "len": 10, "hash": None, "of": ""}
    assert data_changes(saved, identity.of_objects(train=Split(x.clone(), y), test=Rows(10))()) == []
    other = x.clone()
    other[499, 0] += 1  # the last row is always among those read
    assert data_changes(saved, identity.of_objects(train=Split(other, y), test=Rows(12))()) == [
        "the test data (tests.unit.test_identity.Rows): 10 -> 12 samples",
        "the train data (tensors): other values in the same 500 samples"]
    assert data_changes(saved, identity.of_objects(train=Split(x[:400], y[:400]), test=Stream())()) == [
        "the test data: a tests.unit.test_identity.Rows -> a tests.unit.test_identity.Stream",
        "the train data (tensors): 500 -> 400 samples"]
    assert identity.describe([1, 2, 3]) == {"kind": "list", "len": 3, "hash": None, "of": ""}


def test_an_image_folder_is_identified_by_its_file_names(tmp_path):
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(tmp_path / "train" / name / "1.png")
    from distrib.data.named import ImageFiles

    saved = identity.describe(ImageFiles(tmp_path / "train", 0))
    assert saved["len"] == 2 and saved["of"] == "file names"
    shutil.copy(tmp_path / "train" / "a" / "1.png", tmp_path / "train" / "a" / "2.png")
    assert identity.describe(ImageFiles(tmp_path / "train", 0))["len"] == 3
    os.rename(tmp_path / "train" / "a" / "2.png", tmp_path / "train" / "b" / "2.png")
    now = identity.describe(ImageFiles(tmp_path / "train", 0))
    assert now["len"] == 3 and now["hash"] != saved["hash"]


def test_every_source_of_load_data_identifies_its_files_or_objects(tmp_path):
    make_idx_dir(tmp_path / "idx", num_train=40, num_test=9)
    mnist = _load(name="mnist", root=str(tmp_path / "idx"))
    raw = tmp_path / "idx" / "MNIST" / "raw"
    saved = mnist.identity()
    assert [f["path"] for f in saved["files"]] == [str(raw / name) for name in idx.RAW_FILES]
    labels = raw / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:8] + bytes(9))  # the same size, other labels
    assert data_changes(saved, _load(name="mnist", root=str(tmp_path / "idx")).identity()) == [
        f"{labels}: other content (the same 17 bytes)"]

    make_cifar_dir(tmp_path / "cifar" / "cifar-10-batches-py", per_batch=6, num_test=7)
    cifar = _load(name="cifar10", root=str(tmp_path / "cifar")).identity()
    assert [Path(f["path"]).name for f in cifar["files"]] == list(CIFAR_FILES)
    (tmp_path / "a.txt").write_text("to be or not to be " * 20)
    text = _load(name="text", root=str(tmp_path / "a.txt"), seq_len=8).identity()
    assert [f["path"] for f in text["files"]] == [str(tmp_path / "a.txt")]
    for name in ("train.bin", "val.bin"):
        (np.arange(100) % 50).astype(np.uint16).tofile(tmp_path / name)
    tokens = _load(name="tokens", root=str(tmp_path), vocab_size=50, seq_len=8).identity()
    assert [f["path"] for f in tokens["files"]] == [str(tmp_path / "train.bin"), str(tmp_path / "val.bin")]
    make_image_folder(tmp_path / "images", per_class=(2, 1), size=(5, 5))
    images = _load(name="imagefolder", root=str(tmp_path / "images")).identity()
    assert images["files"] == [] and images["objects"]["train"]["of"] == "file names"
    synthetic = _load(name="synthetic", synthetic_train_size=64, synthetic_test_size=16).identity()
    assert synthetic["objects"]["train"]["kind"] == "tensors" and synthetic["objects"]["train"]["len"] == 64
