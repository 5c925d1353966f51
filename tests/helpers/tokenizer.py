"""A tokens run's inputs for the `distrib generate --tokenizer` tests: a small byte-level BPE tokenizer trained with the
`tokenizers` library on a real English text, and that text's ids as nanoGPT's uint16 train.bin and val.bin."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Debian's base-files package (Essential: on every Debian system) ships it; a fixed 35 kB of English prose.
TEXT = Path("/usr/share/common-licenses/GPL-3")


def write_tokenizer_and_ids(root: Path, vocab_size: int = 320) -> tuple[Path, int]:
    """root/tokenizer.json and root/train.bin, root/val.bin (the last tenth of the text); returns the tokenizer's path
    and its vocabulary size (data.vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = TEXT.read_text()
    tokenizer.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer.json"))
    ids = np.array(tokenizer.encode(text).ids, dtype=np.uint16)
    split = len(ids) - len(ids) // 10
    ids[:split].tofile(root / "train.bin")
    ids[split:].tofile(root / "val.bin")
    return root / "tokenizer.json", tokenizer.get_vocab_size()
