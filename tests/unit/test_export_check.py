"""Every run's export checks itself, in one process: a Hugging Face model's weights/ against the architecture its
config.json names (built on meta), a plain model's against the names and shapes written; a folder that lost a
tensor is distrib's own error, naming the file and the tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distrib.checkpoint.export_check import ExportCheckError, check_folder
from distrib.checkpoint.run_weights import write_run_weights
from distrib.checkpoint.weight_files import SINGLE, WEIGHTS_DIR
from distrib.checkpoint.weights import hf_config, model_tensors
from distrib.distributed.strategies.ddp import DDPStrategy
from tests.helpers.pretrained import llama


def _drop(folder, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(folder / SINGLE)
    save_file({key: tensor for key, tensor in state.items() if key != name}, folder / SINGLE)


@pytest.mark.parametrize("tied", [False, True])
def test_a_hugging_face_export_passes_and_one_that_lost_a_tensor_is_caught(tmp_path, tied):
    model = llama(tie_word_embeddings=tied)
    write_run_weights(model, None, tmp_path, 0, DDPStrategy())  # checks itself: raises if it would not load
    folder = tmp_path / WEIGHTS_DIR
    _drop(folder, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ExportCheckError, match=r"weights: .*1 missing \(first model\.layers\.1\.mlp\.up_proj\.weight\)"
                                               r".*distrib's bug, not yours"):
        check_folder(folder, model, model_tensors(model))


def test_a_plain_model_export_is_checked_against_what_was_written(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    write_run_weights(model, None, tmp_path, 0, DDPStrategy())
    folder = tmp_path / WEIGHTS_DIR
    _drop(folder, "2.bias")
    with pytest.raises(ExportCheckError, match=r"1 missing \(first 2\.bias\)"):
        check_folder(folder, model, model_tensors(model))


def test_config_json_names_the_model_class_not_fsdp2s_subclass_of_it():
    from torch.distributed.fsdp import FSDPModule

    model = llama()
    model.__class__ = type(f"FSDP{type(model).__name__}", (FSDPModule, type(model)), {})
    assert hf_config(model).architectures == ["LlamaForCausalLM"]
    assert torch.is_tensor(next(iter(model_tensors(model).values())))
