"""Language models end to end: the built-in GPT on `data.name = text` learns a real text (it beats the text's unigram
model by a clear margin) and `distrib generate` repeats itself for one seed; a `tokens` dataset trains at world size
2 under fsdp as at world size 1; `distrib generate --tokenizer` decodes a tokens run's continuation, the same twice."""

import collections
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from distrib import cli
from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.processes import EVENT_S
from tests.helpers.support import assert_ok, distrib, max_relative_diff, sets, torchrun_train

# Debian's base-files package (Essential: on every Debian system) ships it; a fixed 35 kB of English prose.
TEXT = Path("/usr/share/common-licenses/GPL-3")
TINY_GPT = "model.kwargs={n_layers = 2, n_heads = 2, dim = 64}"
COMMON = ["model.name=gpt", "train.optimizer=adamw", "run.progress=false", "dist.device=cpu", "train.epochs=0",
          "train.eval_every_epochs=0", "checkpoint.every_steps=0"]


def unigram_loss(train: bytes, test: bytes) -> float:
    """Cross-entropy (nats per byte) of the held-out bytes under the training bytes' frequencies, add-one smoothed
    over the 256 byte values: the best a model that ignores context can do."""
    counts = collections.Counter(train)
    total = len(train) + 256
    return -sum(math.log((counts[b] + 1) / total) for b in test) / len(test)


@pytest.mark.timeout(900)
def test_gpt_on_text_beats_the_unigram_model_and_generate_repeats_for_a_seed(tmp_path):
    config = load_config(None, [*COMMON, "data.name=text", f"data.root={TEXT}", "data.seq_len=64", TINY_GPT,
                                "train.lr=3e-3", "train.warmup_steps=20", "train.max_steps=200",
                                "train.global_batch_size=32", "train.log_every=100", f"run.dir={tmp_path}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a launched worker runs: on a loaded machine, 2 spinning threads can be 5x slower
    try:
        summary = run_training(config)
    finally:
        torch.set_num_threads(threads)
    raw = TEXT.read_bytes()
    split = len(raw) - round(len(raw) * 0.1)
    baseline = unigram_loss(raw[:split], raw[split:])
    assert summary["test_loss"] < baseline - 0.5, (summary["test_loss"], baseline)  # 2.81 vs 3.51 nats here
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
    assert summary["tokens_per_second"] == pytest.approx(summary["samples_per_second"] * 64)
    assert summary["mfu"] > 0 and summary["flops_per_sample"] > 0

    from distrib.training.generate import generate_text

    prompt = ["generate", str(tmp_path), "--prompt", "This License ", "--max-new-tokens", "60", "--temperature",
              "0.8", "--top-k", "20"]
    first = distrib(*prompt, "--seed", "7", timeout=EVENT_S)
    assert_ok(first)
    # Again for the seed, in this process (what `distrib generate` prints), and for another seed.
    second, other = (generate_text(str(tmp_path), "This License ", 60, 0.8, 20, seed) + "\n" for seed in (7, 8))
    assert first.stdout == second and first.stdout != other
    assert len(first.stdout.rstrip("\n").encode("utf-8", errors="replace")) >= 50  # 60 bytes (U+FFFD takes 3)


TOKENS = ["data.name=tokens", "data.vocab_size=64", "data.seq_len=16", "model.kwargs={n_layers = 1, n_heads = 2, "
          "dim = 16}", "train.lr=3e-3", "train.warmup_steps=5", "train.global_batch_size=8", "train.log_every=20"]


def _write_tokens(root: Path) -> None:
    """A learnable uint16 stream (a noisy counter modulo 64) as nanoGPT's train.bin and val.bin."""
    rng = np.random.default_rng(0)
    stream = (np.arange(12_000) + rng.integers(0, 3, 12_000)) % 64
    root.mkdir(parents=True)
    stream[:10_000].astype(np.uint16).tofile(root / "train.bin")
    stream[10_000:].astype(np.uint16).tofile(root / "val.bin")


@pytest.mark.timeout(900)
def test_tokens_under_fsdp_agree_with_one_process(tmp_path):
    """(A tokens run whose worker is killed, restarted and bitwise the uninterrupted run: test_token_shards.py; the
    same under fsdp: test_fsdp.py.)"""
    data = tmp_path / "data"
    _write_tokens(data)
    # World size 1 (ddp) takes the same global batches: its 12 steps agree with the 2-rank fsdp run's.
    run = [*COMMON, *TOKENS, f"data.root={data}", "train.max_steps=12", "train.schedule=constant"]
    one = run_training(load_config(None, [*run, f"run.dir={tmp_path}/one"]))
    assert_ok(torchrun_train(2, *sets(*run, "dist.strategy=fsdp", f"run.dir={tmp_path}/two")))
    two = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    assert max_relative_diff(torch.load(tmp_path / "one" / "model.pt", weights_only=True), two) < 1e-5
    assert one["test_perplexity"] == pytest.approx(math.exp(one["test_loss"]))


@pytest.mark.timeout(900)
def test_generate_with_the_tokenizer_of_a_tokens_run_prints_decoded_text_the_same_twice(tmp_path, capfd):
    from transformers import PreTrainedTokenizerFast

    from distrib.training.generate import generate_text
    from tests.helpers.tokenizer import write_tokenizer_and_ids

    tokenizer, vocab_size = write_tokenizer_and_ids(tmp_path / "data")
    run_training(load_config(None, [*COMMON, "data.name=tokens", f"data.root={tmp_path / 'data'}",
                                    f"data.vocab_size={vocab_size}", "data.seq_len=32", "model.kwargs={n_layers = 1, "
                                    "n_heads = 2, dim = 32}", "train.lr=3e-3", "train.warmup_steps=5",
                                    "train.max_steps=30", "train.global_batch_size=16", "train.log_every=10",
                                    f"run.dir={tmp_path / 'run'}"]))
    prompt = ["generate", str(tmp_path / "run"), "--prompt", "The ", "--max-new-tokens", "24", "--seed", "3"]
    first = distrib(*prompt, "--tokenizer", str(tokenizer), timeout=EVENT_S)
    assert_ok(first)
    # Again, in this process (what `distrib generate` prints): the same text for the seed.
    second = generate_text(str(tmp_path / "run"), "The ", 24, seed=3, tokenizer=str(tokenizer)) + "\n"
    assert first.stdout == second and len(first.stdout.strip()) >= 10, first.stdout
    # Decoded text, not ids: the tokenizer's decoding of 24 sampled ids.
    assert not first.stdout.strip().replace(" ", "").isdigit()
    capfd.readouterr()
    code = cli.main(prompt)  # without the tokenizer (as `distrib generate` runs it, here): one line naming it
    said = capfd.readouterr().err
    assert code == 2 and "--tokenizer" in said and "Traceback" not in said, said
    # The same tokenizer as a transformers folder gives the same text for the seed.
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer)).save_pretrained(tmp_path / "folder")
    folder = generate_text(str(tmp_path / "run"), "The ", 24, seed=3, tokenizer=str(tmp_path / "folder"))
    assert folder + "\n" == first.stdout
