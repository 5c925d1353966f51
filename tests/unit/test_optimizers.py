"""distrib.training.optimizers.chunked_steps: torch's foreach optimizers stepped in chunks update bitwise as in one
call, keep their state_dict, and no foreach temporary is larger than a chunk."""

import torch

from distrib.training import optimizers
from distrib.training.optimizers import chunked_steps


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(size, generator=generator)) for size in (300, 7, 500, 120, 64, 900)]


def _train(cls, params, steps: int = 3) -> torch.optim.Optimizer:
    optimizer = cls([{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}], lr=0.01,
                    weight_decay=0.1, foreach=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return optimizer


def test_adamw_in_chunks_is_bitwise_adamw_and_its_temporaries_are_a_chunk(monkeypatch):
    monkeypatch.setattr(optimizers, "MIN_CHUNK_ELEMENTS", 400)
    assert [len(chunk) for chunk in optimizers._chunks(_params(0))] == [2, 1, 2, 1]  # 307, 500, 184, 900
    sqrt, seen = torch._foreach_sqrt, []
    monkeypatch.setattr(torch, "_foreach_sqrt", lambda tensors: seen.append(sum(t.numel() for t in tensors))
                        or sqrt(tensors))
    reference, chunked = _params(0), _params(0)
    plain = _train(torch.optim.AdamW, reference)
    seen.clear()
    stepped = _train(chunked_steps(torch.optim.AdamW), chunked)
    for expected, got in zip(reference, chunked):
        assert torch.equal(expected, got)
    assert seen and max(seen) == 900  # a chunk of at most 400 elements or one tensor; in one call: 927 and 964
    assert isinstance(stepped, torch.optim.AdamW) and type(stepped).__name__ == "AdamW"
    assert stepped.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
    assert len(stepped.param_groups) == 2 and stepped.param_groups[1]["weight_decay"] == 0.0
