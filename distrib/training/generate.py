"""`distrib generate`: a language-model run continues a prompt, sampled with temperature and top-k from a generator
seeded by --seed, so one seed gives the same text every time (on one device type). A text run reads and writes bytes;
a tokens run its tokenizer's ids (--tokenizer: a `tokenizers` JSON file or a `transformers` tokenizer folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from distrib.data.text import BYTE_VOCAB, token_info
from distrib.distributed.runtime import select_device
from distrib.errors import UserError
from distrib.training.losses import logits_of
from distrib.training.trained import Trained, load_trained, rebuilt_model


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be at least 1; e.g. --max-new-tokens 200")
    if not temperature >= 0:
        raise UserError(f"--temperature {temperature}: must be >= 0 (0 = always the likeliest token); e.g. 0.8")
    if top_k < 0:
        raise UserError(f"--top-k {top_k}: must be >= 0 (0 = every token); e.g. --top-k 50")


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
           seed: int = 0, seq_len: int | None = None) -> list[int]:
    """The ids of max_new_tokens new tokens after `prompt`; the context is cropped to the last seq_len tokens (no
    cache: the model is rerun on the whole window, as in nanoGPT's generate). Draws on the CPU from one generator."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    new = []
    for _ in range(max_new_tokens):
        context = tokens if seq_len is None else tokens[:, -seq_len:]
        logits = logits_of(model(context))[0, -1].float().cpu()  # a Hugging Face model's output: its logits
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, len(logits))).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))
        new.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)
    return new


def text_model(trained: Trained, tokenizer: str | None = None) -> nn.Module:
    """The trained model of a data.name = text run (bytes), or of a tokens run when its tokenizer is given, in eval
    mode on dist.device. model.pt holds the whole model whatever the world size or strategy it was trained with."""
    data = trained.config.data
    name = data.name if not data.factory else "a data.factory"
    if name == "text" and tokenizer:
        raise UserError(f"--tokenizer {tokenizer}: {trained.source} was trained on data.name = 'text', which reads "
                        "and writes bytes; drop --tokenizer")
    if name == "tokens" and not tokenizer:
        raise UserError(f"{trained.source}: trained on data.name = 'tokens' (token ids); fix: give the tokenizer that "
                        "made them, --tokenizer tokenizer.json (a Hugging Face tokenizers file) or a transformers "
                        "tokenizer folder")
    if name not in ("text", "tokens"):
        raise UserError(f"{trained.source}: trained on {name!r}, and generate continues language models: it needs a "
                        "run trained on data.name = text (bytes) or tokens (with --tokenizer)")
    vocab_size = BYTE_VOCAB if name == "text" else data.vocab_size
    model = rebuilt_model(trained, token_info(name, data.seq_len, vocab_size))
    return model.to(select_device(trained.config.dist.device, 0)).eval()


def load_tokenizer(path: str) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) of a tokenizers JSON file or a transformers tokenizer folder; no special tokens are added."""
    where = Path(path)
    if not where.exists():
        raise UserError(f"--tokenizer {path}: no such file or folder; give a tokenizer.json or a tokenizer folder")
    package = "transformers" if where.is_dir() else "tokenizers"
    try:
        if where.is_dir():
            from transformers import AutoTokenizer

            loaded = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
            return (lambda text: loaded.encode(text, add_special_tokens=False)), loaded.decode
        from tokenizers import Tokenizer

        loaded = Tokenizer.from_file(str(where))
        return (lambda text: loaded.encode(text, add_special_tokens=False).ids), loaded.decode
    except ImportError:
        raise UserError(f"--tokenizer {path}: reading it needs the {package} package; pip install {package}") from None
    except Exception as e:  # noqa: BLE001 - whatever the library says about a file that is no tokenizer
        said = " ".join(str(e).split())[:200] or type(e).__name__
        raise UserError(f"--tokenizer {path}: {package} cannot read it ({said}); give a tokenizer.json or a "
                        "transformers tokenizer folder") from None


def generate_text(source: str, prompt: str, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                  seed: int = 0, tokenizer: str | None = None) -> str:
    """The continuation of `prompt` by the language-model run in `source`: bytes decoded as UTF-8 (a byte sequence
    that is not valid UTF-8 shows as U+FFFD), or the tokenizer's ids decoded by it."""
    check_sampling(max_new_tokens, temperature, top_k)
    trained = load_trained(source)
    model = text_model(trained, tokenizer)
    if tokenizer:
        encode, decode = load_tokenizer(tokenizer)
    else:
        encode, decode = (lambda text: list(text.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", "replace"))
    prompt_ids = encode(prompt)
    if not prompt_ids:
        raise UserError(f"--prompt {prompt!r}: gives no tokens to continue; e.g. --prompt 'The '")
    vocab_size = model_vocab(trained)
    if max(prompt_ids) >= vocab_size:
        raise UserError(f"--tokenizer {tokenizer}: it encodes the prompt to id {max(prompt_ids)}, outside the run's "
                        f"vocabulary of {vocab_size} (data.vocab_size); give the tokenizer the run was trained with")
    new = sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed, trained.config.data.seq_len)
    return continuation(decode, prompt_ids, new)


def model_vocab(trained: Trained) -> int:
    data = trained.config.data
    return BYTE_VOCAB if data.name == "text" else data.vocab_size


def continuation(decode: Callable[[list[int]], str], prompt_ids: list[int], new: list[int]) -> str:
    """The text of the new ids as they read after the prompt: decoded with it, the prompt's text cut off (a decoder
    may join tokens differently at the start of a text, e.g. dropping a leading space)."""
    before, whole = decode(prompt_ids), decode(prompt_ids + new)
    return whole[len(before):] if whole.startswith(before) else decode(new)
