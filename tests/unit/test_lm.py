"""The language-model parts in process: the GPT (causal, tied, its FLOP count, its FSDP units and checkpointed blocks),
the text and tokens sources (windows from (seed, epoch, index), every test token once, memory-mapped files, one-line
errors), sampling for `distrib generate`, and tokens/s."""

from pathlib import Path

import numpy as np
import pytest
import torch

from distrib.config import load_config
from distrib.data import eval_batches, load_data
from distrib.data.text import IGNORE_INDEX, token_info, window_starts
from distrib.distributed.fsdp import checkpoint_activations, find_blocks
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError, UserError
from distrib.models.build import build_model
from distrib.models.gpt import GPT, Block
from distrib.training.generate import sample
from distrib.training.throughput import Throughput, flops_per_sample

CPU = Runtime(0, 0, 1, 1, torch.device("cpu"), backend="none")


def _gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 50, "seq_len": 16, "n_layers": 2, "n_heads": 2, "dim": 16, **kwargs})


def test_gpt_is_causal_and_maps_tokens_to_next_token_logits():
    model = _gpt()
    tokens = torch.randint(0, 50, (3, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 50
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (3, 16, 50)
    assert torch.equal(logits[:, :9], logits_changed[:, :9])  # no position sees a later token
    assert not torch.allclose(logits[:, 9:], logits_changed[:, 9:])
    assert torch.allclose(model(tokens[:, :5]), logits[:, :5], atol=1e-6)  # shorter sequences (other kernels)


def test_gpt_weight_tying_and_its_flop_count_by_hand():
    tied, untied = _gpt(), _gpt(tie_weights=False)
    assert tied.output.weight is tied.tok_embeddings.weight
    dim, hidden, vocab, layers, heads, seq = 16, 64, 50, 2, 2, 16  # hidden: 8/3 x 16 rounded up to 64
    per_layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim  # q, k, v, out; w1, w2, w3; two norm gains
    matrix_params = layers * per_layer + dim + vocab * dim  # final norm; output (the tied table counted once)
    attention = 12 * layers * heads * (dim // heads) * seq
    assert tied.flops_per_token() == 6 * matrix_params + attention
    assert untied.flops_per_token() == 6 * matrix_params + attention  # the untied lookup table does no product
    assert sum(p.numel() for p in untied.parameters()) == matrix_params + vocab * dim
    inputs = torch.randint(0, vocab, (2, seq))
    assert flops_per_sample(tied, inputs, inputs) == tied.flops_per_token(seq) * seq


def test_gpt_state_dict_round_trip_through_the_config_builder():
    config = load_config(None, ["model.name=gpt", "model.kwargs={n_layers = 1, n_heads = 2, dim = 8}"])
    info = token_info("text", 12, 256)
    model = build_model(config.model, info)
    assert (model.vocab_size, model.seq_len, model.n_layers) == (256, 12, 1)
    other = build_model(config.model, info)
    other.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (2, 12))
    assert torch.equal(model(tokens), other(tokens))
    assert other.output.weight is other.tok_embeddings.weight  # loading keeps the tie


def test_gpt_refuses_image_data_in_one_line():
    from distrib.data import DataInfo

    config = load_config(None, ["model.name=gpt"])
    with pytest.raises(UserError, match=r"model.name = 'gpt': takes token ids \[seq_len\].*inputs are 1x28x28"):
        build_model(config.model, DataInfo("fashion-mnist", (1, 28, 28), 10, (), (0.0,), (1.0,)))


def test_shard_modules_auto_and_activation_checkpointing_act_on_the_blocks():
    model = _gpt(n_layers=3)
    blocks = find_blocks(model, "auto")
    assert len(blocks) == 3 and all(isinstance(b, Block) for b in blocks)  # not the (tied) embedding
    tokens = torch.randint(0, 50, (2, 16))
    reference = _gpt(n_layers=3)
    assert checkpoint_activations(model, "auto") == 3
    for m in (model, reference):
        torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name  # recomputation gives the same bits


# ---------------------------------------------------------------- text and tokens


def _text_data(tmp_path: Path, text: str, *overrides: str):
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    config = load_config(None, ["data.name=text", f"data.root={path}", *overrides])
    return load_data(config.data, CPU, seed=3, log=lambda message: None)


def test_text_windows_depend_only_on_seed_epoch_and_index(tmp_path):
    data = _text_data(tmp_path, "".join(chr(97 + i % 26) for i in range(2000)), "data.seq_len=8")
    stream = torch.tensor(list("".join(chr(97 + i % 26) for i in range(2000)).encode()))
    whole = next(data.train.batches([torch.arange(6)], epoch=2))
    parts = list(data.train.batches([torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])], epoch=2))
    assert torch.equal(whole[0], torch.cat([p[0] for p in parts]))  # any split of the batch: the same windows
    starts = window_starts(3, 2, np.arange(6), data.train.num_tokens - 8)
    for row, start in enumerate(starts):
        assert torch.equal(whole[0][row], stream[start:start + 8])
        assert torch.equal(whole[1][row], stream[start + 1:start + 9])  # targets: the next tokens
    other_epoch = next(data.train.batches([torch.arange(6)], epoch=3))
    assert not torch.equal(whole[0], other_epoch[0])
    assert data.train.num_samples == (data.train.num_tokens - 1) // 8


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_text_evaluation_predicts_every_held_out_byte_once(tmp_path, world_size):
    text = "héllo wörld, " * 97  # multi-byte UTF-8: bytes, not characters
    data = _text_data(tmp_path, text, "data.seq_len=16", "data.test_fraction=0.2")
    raw = text.encode()
    held_out = raw[len(raw) - round(len(raw) * 0.2):]
    targets = []
    for rank in range(world_size):
        for inputs, batch_targets in data.test.batches(eval_batches(data.test.num_samples, 5, rank, world_size)):
            assert inputs.dtype == torch.int64 and inputs.shape == batch_targets.shape
            targets += batch_targets[batch_targets != IGNORE_INDEX].tolist()
    assert bytes(targets) == held_out  # in order, none twice, none left out
    assert data.info.num_classes == 256 and data.info.input_shape == (16,)


def test_text_folder_is_its_txt_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second " * 40)
    (tmp_path / "a.txt").write_text("first " * 40)
    (tmp_path / "notes.md").write_text("ignored")
    config = load_config(None, ["data.name=text", f"data.root={tmp_path}", "data.seq_len=4"])
    data = load_data(config.data, CPU, seed=0, log=lambda message: None)
    assert data.train.num_tokens + data.test.num_tokens - 1 == len(("first " * 40 + "second " * 40).encode())


def test_text_errors_are_one_line(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_data(load_config(None, ["data.name=text", f"data.root={bad}"]).data, CPU, 0, lambda m: None)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(UserError, match=r"data.seq_len = 256: .* too few for one window"):
        load_data(load_config(None, ["data.name=text", f"data.root={short}"]).data, CPU, 0, lambda m: None)


def _write_tokens(root: Path, train: np.ndarray, val: np.ndarray) -> None:
    root.mkdir(parents=True, exist_ok=True)
    train.astype(np.uint16).tofile(root / "train.bin")
    val.astype(np.uint16).tofile(root / "val.bin")


def test_tokens_are_memory_mapped_windows_of_train_bin_and_val_bin(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 5000), rng.integers(0, 1000, 301)
    _write_tokens(tmp_path, train, val)
    config = load_config(None, ["data.name=tokens", f"data.root={tmp_path}", "data.vocab_size=1000", "data.seq_len=32"])
    data = load_data(config.data, CPU, seed=1, log=lambda message: None)
    assert data.info.num_classes == 1000 and data.test.num_samples == 10  # 300 targets in windows of 32
    inputs, targets = next(data.train.batches([torch.tensor([7, 2])], epoch=0))
    for row, start in enumerate(window_starts(1, 0, np.array([7, 2]), 5000 - 32)):
        assert inputs[row].tolist() == train[start:start + 32].tolist()
        assert targets[row].tolist() == train[start + 1:start + 33].tolist()
    seen = [t for _, y in data.test.batches(eval_batches(10, 4, 0, 1)) for t in y[y != IGNORE_INDEX].tolist()]
    assert seen == val[1:].tolist()


def test_tokens_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"data.vocab_size = 0: data.name = tokens needs the vocabulary size"):
        load_config(None, ["data.name=tokens"])
    _write_tokens(tmp_path, np.arange(100) % 60, np.arange(10))
    config = load_config(None, ["data.name=tokens", f"data.root={tmp_path}", "data.vocab_size=50", "data.seq_len=8"])
    data = load_data(config.data, CPU, seed=0, log=lambda message: None)
    with pytest.raises(UserError, match=r"data.vocab_size = 50: .*train.bin holds token id (5\d) \(its token 5\d\); "
                                        r"fix: --set data.vocab_size=(5\d|60) or more"):
        list(data.train.batches([torch.arange(12)], epoch=0))
    (tmp_path / "val.bin").unlink()
    with pytest.raises(UserError, match=r"no val.bin; fix: give the folder holding nanoGPT's train.bin and val.bin"):
        load_data(config.data, CPU, seed=0, log=lambda message: None)


# ---------------------------------------------------------------- generate and tokens/s


def test_sampling_is_deterministic_per_seed_and_top_1_is_greedy():
    model = _gpt().eval()
    runs = [sample(model, [1, 2, 3], 20, temperature=1.0, seed=seed, seq_len=16) for seed in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2] and len(runs[0]) == 20
    greedy = sample(model, [1, 2, 3], 20, temperature=0.0, seq_len=16)
    assert sample(model, [1, 2, 3], 20, temperature=0.7, top_k=1, seed=9, seq_len=16) == greedy
    with torch.no_grad():  # the first greedy token is the argmax of the prompt's last logits
        assert greedy[0] == int(model(torch.tensor([[1, 2, 3]]))[0, -1].argmax())


def test_tokens_per_second_is_samples_per_second_times_the_sequence_length():
    meter = Throughput(global_batch_size=8, world_size=2, skip_steps=0)
    meter.tokens_per_sample = 64
    meter.restart_clock()
    for _ in range(3):
        meter.step_done()
    stats = meter.summary()
    assert stats["tokens_per_second"] == pytest.approx(stats["samples_per_second"] * 64)
    assert stats["tokens_per_second_per_device"] == pytest.approx(stats["tokens_per_second"] / 2)
    assert "tokens_per_second" not in Throughput(8, 1).summary()  # image runs: no token keys


def test_generate_needs_the_tokenizer_of_a_tokens_run_and_refuses_bad_sampling_in_one_line(tmp_path):
    from distrib.training.generate import check_sampling, load_tokenizer, text_model
    from distrib.training.trained import Trained

    config = load_config(None, ["data.name=tokens", "data.vocab_size=100", "model.name=gpt"])
    with pytest.raises(UserError, match=r"trained on data.name = 'tokens' \(token ids\); fix: give the tokenizer that "
                                        r"made them, --tokenizer tokenizer.json"):
        text_model(Trained(tmp_path, config, {}, None, None))
    text = load_config(None, ["data.name=text", "model.name=gpt"])
    with pytest.raises(UserError, match=r"^--tokenizer t.json: .* trained on data.name = 'text', which reads and "
                                        r"writes bytes; drop --tokenizer"):
        text_model(Trained(tmp_path, text, {}, None, None), "t.json")
    (tmp_path / "broken.json").write_text("{}")
    for path, message in ((tmp_path / "none.json", r"no such file or folder"),
                          (tmp_path / "broken.json", r"tokenizers cannot read it \(.*\); give a tokenizer.json")):
        with pytest.raises(UserError, match=rf"^--tokenizer {path}: {message}"):
            load_tokenizer(str(path))
    for args, message in (((0, 1.0, 0), r"--max-new-tokens 0: must be at least 1"),
                          ((5, -1.0, 0), r"--temperature -1.0: must be >= 0"), ((5, 1.0, -2), r"--top-k -2")):
        with pytest.raises(UserError, match=message):
            check_sampling(*args)


def test_a_tokenizer_file_and_its_transformers_folder_encode_and_decode_alike(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from distrib.training.generate import continuation, load_tokenizer
    from tests.helpers.tokenizer import write_tokenizer_and_ids

    path, vocab_size = write_tokenizer_and_ids(tmp_path / "data", vocab_size=300)
    PreTrainedTokenizerFast(tokenizer_file=str(path)).save_pretrained(tmp_path / "folder")
    encode, decode = load_tokenizer(str(path))
    encode_folder, decode_folder = load_tokenizer(str(tmp_path / "folder"))
    prompt = "The program is free "
    ids = encode(prompt)
    assert ids == encode_folder(prompt) and max(ids) < vocab_size and decode(ids) == prompt
    new = encode("software, for all its users.")
    assert continuation(decode, ids, new) == continuation(decode_folder, ids, new) == "software, for all its users."
