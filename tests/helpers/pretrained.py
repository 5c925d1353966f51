"""A tiny Hugging Face Llama for the model.init_from tests (nothing downloaded): saved by save_pretrained into several
safetensors files, built from its config with random weights (`model.factory = tests.helpers.pretrained:llama`, for
model.init_from), or loaded by from_pretrained in the factory itself (the reference); a tiny Mixtral and Qwen3-MoE
likewise; and byte windows as dict
samples (input_ids, attention_mask, labels) for `data.factory = tests.helpers.pretrained:token_dicts`."""

from __future__ import annotations

from pathlib import Path

import torch

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)


def llama_config(**changes):
    from transformers import LlamaConfig

    return LlamaConfig(**{**SIZES, **changes})


def llama(**changes):
    """Random weights, to be replaced by model.init_from."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(**changes))


def llama_from_pretrained(folder: str):
    """The reference: a factory that loads the folder itself."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder)


def save_llama(folder: Path, seed: int = 7, max_shard_size: str = "40KB", **changes) -> Path:
    """A Llama of seeded weights saved in several files with model.safetensors.index.json; returns the folder."""
    torch.manual_seed(seed)
    llama(**changes).save_pretrained(folder, max_shard_size=max_shard_size)
    return Path(folder)


def qwen2(**changes):
    """A tiny Qwen2 (biases on q, k and v) of the Llama's sizes, random weights, to be replaced by model.init_from."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**SIZES, **changes}))


def save_qwen2(folder: Path, seed: int = 7) -> Path:
    torch.manual_seed(seed)
    qwen2().save_pretrained(folder)
    return Path(folder)


# Tiny mixtures of experts of transformers' own classes: 2 layers, dim 64, 4 experts, top 2, the router's aux loss
# in outputs.loss (output_router_logits). save_pretrained writes the Hub's per-expert tensors; the model holds them
# fused (mlp.experts.gate_up_proj, down_proj), which model.init_from reaches through transformers' conversion.
MOE_SIZES = dict(SIZES, hidden_size=64, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)


def mixtral(**changes):
    """A Mixtral (block_sparse_moe.experts.N.w1/w2/w3 in the Hub's files), random weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**{**MOE_SIZES, "num_local_experts": 4, **changes}))


def qwen3_moe(**changes):
    """A Qwen3-MoE (mlp.experts.N.gate_proj/up_proj/down_proj in the Hub's files), random weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE_SIZES, "num_experts": 4, "moe_intermediate_size": 32,
                                                 "head_dim": 16, **changes}))


def moe_from_pretrained(folder: str):
    """The reference: the folder's model, loaded by from_pretrained (whichever of the two it is)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def moe_from_config(folder: str):
    """The factory users write, taking only the folder: its architecture with random weights (model.init_from reads
    the folder's); the launcher builds it on the meta device before any worker starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def lora_moe(folder: str, r: int = 4, targets: str = "q_proj,v_proj"):
    """moe_from_config wrapped by peft's LoRA on `targets` (gate_proj,up_proj,down_proj: on the fused experts)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(moe_from_config(folder), LoraConfig(r=r, lora_alpha=2 * r,
                                                              target_modules=targets.split(",")))


def save_moe(folder: Path, family: str = "mixtral", seed: int = 7, max_shard_size: str = "10MB") -> Path:
    """A mixture of experts of seeded weights saved by save_pretrained (the Hub's layout); returns the folder."""
    torch.manual_seed(seed)
    {"mixtral": mixtral, "qwen3_moe": qwen3_moe}[family]().save_pretrained(folder, max_shard_size=max_shard_size)
    return Path(folder)


class TokenDicts(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def token_dicts(num_train: int = 96, num_test: int = 24, seq_len: int = 16):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (num_train + num_test, seq_len), generator=generator)
    return TokenDicts(ids[:num_train]), TokenDicts(ids[num_train:])


def damaged_weights(folder: Path) -> dict[str, Path]:
    """The three damaged safetensors files of the fault sweep, each in a folder of its own beside a saved Llama's
    model.safetensors: cut in half, its first 50 bytes, and 4 KiB of random bytes."""
    whole = (save_llama(Path(folder) / "whole", max_shard_size="10MB") / "model.safetensors").read_bytes()
    generator = torch.Generator().manual_seed(3)
    damaged = {"truncated": whole[:len(whole) // 2], "fifty_bytes": whole[:50],
               "random": bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=generator).tolist())}
    paths = {}
    for name, data in damaged.items():
        paths[name] = Path(folder) / name / "model.safetensors"
        paths[name].parent.mkdir(parents=True)
        paths[name].write_bytes(data)
    return paths


def lora_llama(r: int = 4, targets: str = "q_proj,v_proj"):
    """The Llama wrapped by peft's LoRA on `targets` (base weights from model.init_from; the adapter's own init);
    it dies as tests.helpers.dying_model.dying says."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers.dying_model import dying

    return dying(get_peft_model(llama(), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets.split(","))))


def lora_from_pretrained(folder: str, r: int = 4, targets: str = "q_proj,v_proj"):
    """A factory that loads the base itself (from_pretrained), then wraps it: what users write first."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama_from_pretrained(folder), LoraConfig(r=r, lora_alpha=2 * r,
                                                                    target_modules=targets.split(",")))
