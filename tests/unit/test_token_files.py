"""Token shards in process (data.train_files / data.test_files): llm.c's shards (GPT-2's uint16, Llama 3's uint32)
and raw files (uint16, or uint32 by data.token_dtype) read as one stream per split, windows across shard boundaries,
every held-out token once; truncated and foreign files refused with one line naming them, as is a file cut short
under a live run, a token id over the vocabulary and uint16 ids under a vocabulary over 65,536; files opened anew in
another process."""

import os
import pickle

import numpy as np
import pytest
import torch

from distrib.config import load_config
from distrib.data import eval_batches, load_data
from distrib.data.text import IGNORE_INDEX, window_starts
from distrib.data.token_files import TokenStream, find_shards
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError, UserError
from tests.helpers.token_shards import LLAMA3, LLAMA3_VOCAB, write_llmc, write_llmc_shards

CPU = Runtime(0, 0, 1, 1, torch.device("cpu"), backend="none")


def _load(train: str, test: str, *extra: str):
    return _load_tokens("data.vocab_size=1000", f"data.train_files={train}", f"data.test_files={test}", *extra)


def _load_tokens(*overrides: str):
    config = load_config(None, ["data.name=tokens", "data.seq_len=32", *overrides])
    return load_data(config.data, CPU, seed=1, log=lambda message: None)


def test_llmc_shards_are_one_stream_per_split_and_every_test_token_is_a_target_once(tmp_path):
    stream = np.random.default_rng(0).integers(0, 1000, 4000)
    train, val = write_llmc_shards(tmp_path, stream, (1000, 700, 1300))
    data = _load(train, val)
    assert data.train.num_tokens == 3000 and data.test.num_tokens == 1000
    indices = np.arange(90)  # 90 windows: some span two shards (starts within 32 tokens before 1000 or 1700)
    inputs, targets = next(data.train.batches([torch.from_numpy(indices)], epoch=3))
    starts = window_starts(1, 3, indices, 3000 - 32)
    assert any(s < 1000 < s + 33 or s < 1700 < s + 33 for s in starts)
    for row, start in enumerate(starts):
        assert inputs[row].tolist() == stream[start:start + 32].tolist()
        assert targets[row].tolist() == stream[start + 1:start + 33].tolist()
    num_windows = data.test.num_samples
    seen = [t for _, y in data.test.batches(eval_batches(num_windows, 4, 0, 1)) for t in y[y != IGNORE_INDEX].tolist()]
    assert seen == stream[3001:].tolist()  # all of the val shard but its first token, which has no predecessor


def test_raw_uint16_shards_read_like_llmc_ones(tmp_path):
    stream = np.random.default_rng(1).integers(0, 1000, 3000)
    for index, part in enumerate(np.split(stream[:2400], [1000])):
        part.astype(np.uint16).tofile(tmp_path / f"raw_train_{index}.bin")
    stream[2400:].astype(np.uint16).tofile(tmp_path / "raw_val.bin")
    data = _load(str(tmp_path / "raw_train_*.bin"), str(tmp_path / "raw_val.bin"))
    inputs, _ = next(data.train.batches([torch.arange(5)], epoch=0))
    for row, start in enumerate(window_starts(1, 0, np.arange(5), 2400 - 32)):
        assert inputs[row].tolist() == stream[start:start + 32].tolist()
    assert data.test.num_tokens == 600


def test_truncated_foreign_and_mixed_shards_are_one_line_naming_the_file(tmp_path):
    ids = np.arange(500) % 100
    write_llmc(tmp_path / "cut.bin", ids, count=600)
    write_llmc(tmp_path / "v2.bin", ids, version=2)
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    write_llmc(tmp_path / "long.bin", ids, count=400)
    cases = {"cut.bin": r"cut.bin is truncated: its header says 600 tokens, the file holds 500; fix",
             "v2.bin": r"v2.bin is an llm.c shard of magic 20240520 version 2, which distrib does not read",
             "odd.bin": r"odd.bin has 3 bytes, so it is neither uint16 token ids .* nor an llm.c shard",
             "long.bin": r"long.bin has 1000 bytes after its header, which says 400 tokens"}
    for name, message in cases.items():
        with pytest.raises(UserError, match=r"^data.train_files: .*" + message) as error:
            find_shards("data.train_files", str(tmp_path / name))
        assert "\n" not in str(error.value)
    write_llmc(tmp_path / "mixed" / "a.bin", ids)
    ids.astype(np.uint16).tofile(tmp_path / "mixed" / "b.bin")
    with pytest.raises(UserError, match=r"b.bin has no llm.c header \(magic 20240520 version 1 .* though .*a.bin has"):
        find_shards("data.train_files", str(tmp_path / "mixed" / "*.bin"))
    write_llmc(tmp_path / "tokenizers" / "a.bin", ids)
    write_llmc(tmp_path / "tokenizers" / "b.bin", ids, **LLAMA3)
    with pytest.raises(UserError, match=r"b.bin holds uint32 ids though .*a.bin holds uint16 ones \(llm.c shards of "
                                        r"two tokenizers\); fix: give the shards of one tokenizer$"):
        find_shards("data.train_files", str(tmp_path / "tokenizers" / "*.bin"))
    with pytest.raises(UserError, match=r"data.test_files = .*nothing\*.bin': matches no file"):
        _load(str(tmp_path / "mixed" / "a.bin"), str(tmp_path / "nothing*.bin"))
    with pytest.raises(UserError, match=r"a.bin is also a training file"):
        _load(str(tmp_path / "mixed" / "a.bin"), str(tmp_path / "mixed" / "a.bin"))


def test_token_files_config_is_checked():
    with pytest.raises(ConfigError, match=r"data.token_dtype = 'int32'.*uint16, uint32"):
        load_config(None, ["data.name=tokens", "data.vocab_size=10", "data.token_dtype=int32"])
    with pytest.raises(ConfigError, match=r"data.vocab_size = 4294967297: must be in \[0, 4294967296\]"):
        load_config(None, ["data.name=tokens", f"data.vocab_size={2**32 + 1}"])
    with pytest.raises(ConfigError, match=r"data.test_files = '': data.train_files is set, so the other split"):
        load_config(None, ["data.name=tokens", "data.vocab_size=10", "data.train_files=a*.bin"])
    with pytest.raises(ConfigError, match=r"data.train_files = 'a\*.bin': names token shards, read only by "):
        load_config(None, ["data.name=text", "data.train_files=a*.bin", "data.test_files=b*.bin"])


def test_files_are_opened_per_process(tmp_path):
    write_llmc(tmp_path / "a.bin", np.arange(100))
    stream = TokenStream(find_shards("k", str(tmp_path / "a.bin")))
    assert stream(np.array([[3, 4]])).tolist() == [[3, 4]]
    copy = pickle.loads(pickle.dumps(stream))  # what a DataLoader worker (spawn) receives
    assert copy._files is None and copy(np.array([99])).tolist() == [99]
    stream._pid = -2  # as after a fork: another pid opens the files itself
    before = stream._files
    stream(np.array([0]))
    assert stream._files is not before


def test_any_positions_read_across_shards_as_numpy_indexing_would(tmp_path):
    stream_ids = np.random.default_rng(2).integers(0, 60000, 900)
    write_llmc(tmp_path / "a.bin", stream_ids[:400])
    write_llmc(tmp_path / "b.bin", stream_ids[400:])
    stream = TokenStream(find_shards("k", str(tmp_path / "*.bin")))
    windows = np.arange(380, 420)[None, :] + np.array([[0], [10], [-380], [480]])  # within a, across, within b
    scattered = np.array([[899, 0, 400, 399, 5, 5], [7, 3, 1, 898, 401, 2]])  # not in order, repeated
    for positions in (windows, scattered, np.array([899]), np.array([[[1, 2], [3, 899]]])):
        assert torch.equal(stream(positions), torch.from_numpy(stream_ids[positions]))


def test_a_shard_cut_short_under_a_live_stream_is_one_line_naming_it(tmp_path):
    write_llmc(tmp_path / "a.bin", np.arange(500) % 100)
    write_llmc(tmp_path / "b.bin", np.arange(500) % 100)
    stream = TokenStream(find_shards("data.train_files", str(tmp_path / "*.bin")))
    assert stream(np.arange(490, 510)[None, :]).tolist() == [[*range(90, 100), *range(10)]]
    os.truncate(tmp_path / "b.bin", 1024 + 2 * 300)  # under the open file, as another process would cut it
    assert stream(np.arange(600, 610)[None, :]).tolist() == [list(range(100))[:10]]  # what is left reads on
    with pytest.raises(UserError) as error:
        stream(np.arange(490, 810)[None, :])  # a memory map's read here would end the process with SIGBUS
    assert str(error.value) == (
        f"data.train_files: {tmp_path}/b.bin was cut short under the run: it holds 1624 bytes, 2024 when the run "
        "opened it; fix: restore the file and run the same command again (it resumes from the last checkpoint)")


def test_a_token_id_over_the_vocabulary_names_its_file_and_position(tmp_path):
    ids = np.arange(2000) % 90
    ids[1234] = 97
    train, val = write_llmc_shards(tmp_path, ids, (1000, 700))
    data = _load(train, val, "data.vocab_size=90")
    with pytest.raises(UserError) as error:
        for _ in data.train.batches([torch.arange(52)], epoch=0):  # 52 windows at hashed starts: one holds it
            pass
    assert str(error.value) == (
        f"data.vocab_size = 90: {tmp_path}/shard_train_000001.bin holds token id 97 (its token 234); fix: --set "
        "data.vocab_size=98 or more (the tokenizer's vocabulary)")


def test_llama3_shards_of_uint32_ids_read_as_one_stream_with_a_vocabulary_of_128256(tmp_path):
    stream = np.random.default_rng(3).integers(LLAMA3_VOCAB - 70_000, LLAMA3_VOCAB, 3000)  # most over 65,535
    train, val = write_llmc_shards(tmp_path, stream, (1000, 1200), **LLAMA3)
    data = _load_tokens(f"data.vocab_size={LLAMA3_VOCAB}", f"data.train_files={train}", f"data.test_files={val}")
    assert data.train.num_tokens == 2200 and data.test.num_tokens == 800
    inputs, targets = next(data.train.batches([torch.arange(60)], epoch=1))
    starts = window_starts(1, 1, np.arange(60), 2200 - 32)
    assert any(start < 1000 < start + 33 for start in starts)  # a window across the two shards
    for row, start in enumerate(starts):
        assert inputs[row].tolist() == stream[start:start + 32].tolist()
        assert targets[row].tolist() == stream[start + 1:start + 33].tolist()
    seen = [t for _, y in data.test.batches(eval_batches(data.test.num_samples, 4, 0, 1))
            for t in y[y != IGNORE_INDEX].tolist()]
    assert seen == stream[2201:].tolist()
    write_llmc(tmp_path / "cut.bin", stream[:500], count=600, **LLAMA3)
    with pytest.raises(UserError, match=r"cut.bin is truncated: its header says 600 tokens, the file holds 500; fix"):
        find_shards("data.train_files", str(tmp_path / "cut.bin"))


def test_raw_files_are_read_by_the_declared_token_dtype(tmp_path):
    stream = np.random.default_rng(4).integers(0, LLAMA3_VOCAB, 3000)
    for name, part in (("train.bin", stream[:2400]), ("val.bin", stream[2400:])):
        part.astype(np.uint32).tofile(tmp_path / name)  # nanoGPT's layout, Llama 3's ids
    for data in (_load_tokens(f"data.vocab_size={LLAMA3_VOCAB}", f"data.root={tmp_path}", "data.token_dtype=uint32"),
                 _load_tokens(f"data.vocab_size={LLAMA3_VOCAB}", f"data.train_files={tmp_path}/train.bin",
                              f"data.test_files={tmp_path}/val.bin", "data.token_dtype=uint32")):
        inputs, _ = next(data.train.batches([torch.arange(5)], epoch=0))
        for row, start in enumerate(window_starts(1, 0, np.arange(5), 2400 - 32)):
            assert inputs[row].tolist() == stream[start:start + 32].tolist()
        assert (data.train.num_tokens, data.test.num_tokens) == (2400, 600)
    # The same files read as uint16 (the default): refused before any window, the fix named.
    for where in ([f"data.root={tmp_path}"],
                  [f"data.train_files={tmp_path}/train.bin", f"data.test_files={tmp_path}/val.bin"]):
        with pytest.raises(UserError) as error:
            _load_tokens(f"data.vocab_size={LLAMA3_VOCAB}", *where)
        assert str(error.value) == (
            f"data.vocab_size = 128256: {tmp_path}/train.bin is read as uint16 token ids (data.token_dtype), which "
            "stop at 65,535; fix: --set data.token_dtype=uint32 if it holds uint32 ids (np.array(ids, "
            "dtype=np.uint32).tofile(path)), or give the vocabulary of the tokenizer that wrote it")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "train.bin").write_bytes(b"\0" * 4098)
    (tmp_path / "odd" / "val.bin").write_bytes(b"\0" * 400)
    with pytest.raises(UserError, match=r"^data.root: .*train.bin has 4098 bytes, not a multiple of 4, so it is not "
                                        r"uint32 token ids \(data.token_dtype\); fix: write it with np.array"):
        _load_tokens("data.vocab_size=100", f"data.root={tmp_path}/odd", "data.token_dtype=uint32")
    with pytest.raises(UserError, match=r"^data.train_files: .*train.bin has 4098 bytes, so it is neither uint32 "):
        _load_tokens("data.vocab_size=100", f"data.train_files={tmp_path}/odd/train.bin",
                     f"data.test_files={tmp_path}/odd/val.bin", "data.token_dtype=uint32")
    write_llmc(tmp_path / "gpt2" / "a.bin", stream[:100] % 50_000)  # GPT-2's shards under Llama 3's vocabulary
    with pytest.raises(UserError, match=r"a.bin is read as uint16 token ids \(its llm.c header\), which stop at "):
        _load_tokens(f"data.vocab_size={LLAMA3_VOCAB}", f"data.train_files={tmp_path}/gpt2/a.bin",
                     f"data.test_files={tmp_path}/val.bin", "data.token_dtype=uint32")
