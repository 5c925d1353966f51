"""`distrib generate`: a text run's model continues a prompt, byte by byte, sampled with temperature and top-k from a
generator seeded by --seed, so one seed gives the same text every time (on one device type)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.data.text import BYTE_VOCAB, token_info
from distrib.distributed.runtime import select_device
from distrib.errors import UserError
from distrib.training.inference import Trained, load_trained, rebuilt_model


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be at least 1; e.g. --max-new-tokens 200")
    if not temperature >= 0:
        raise UserError(f"--temperature {temperature}: must be >= 0 (0 = always the likeliest byte); e.g. 0.8")
    if top_k < 0:
        raise UserError(f"--top-k {top_k}: must be >= 0 (0 = every byte); e.g. --top-k 50")


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
        logits = model(context)[0, -1].float().cpu()
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


def text_model(trained: Trained) -> nn.Module:
    """The trained model of a data.name = text run, in eval mode on dist.device. model.pt holds the whole model
    whatever the world size or strategy it was trained with (fsdp gathers it on rank 0)."""
    config = trained.config
    if config.data.name != "text" or config.data.factory:
        raise UserError(f"{trained.source}: trained on data.name = {config.data.name!r}, and generate reads and "
                        "writes bytes, so it needs a run trained on data.name = text (byte-level tokens)")
    model = rebuilt_model(trained, token_info("text", config.data.seq_len, BYTE_VOCAB))
    return model.to(select_device(config.dist.device, 0)).eval()


def generate_text(source: str, prompt: str, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                  seed: int = 0) -> str:
    """The continuation of `prompt` (its UTF-8 bytes) by the text run in `source`, decoded as UTF-8 (a byte
    sequence that is not valid UTF-8 shows as U+FFFD)."""
    check_sampling(max_new_tokens, temperature, top_k)
    prompt_ids = list(prompt.encode("utf-8"))
    if not prompt_ids:
        raise UserError("--prompt '': give at least one character to continue, e.g. --prompt 'The '")
    trained = load_trained(source)
    model = text_model(trained)
    new = sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed, trained.config.data.seq_len)
    return bytes(new).decode("utf-8", errors="replace")
