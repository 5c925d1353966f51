"""LoRA on a Hugging Face Llama as people fine-tune (peft, r 4 on q_proj and v_proj; the base from a local
safetensors folder by model.init_from): one process under ddp against fsdp and hsdp at world size 2, in one launch,
within 1e-5 on the adapter with every base tensor bitwise the folder's; stopped by SIGTERM at step 3 and run again,
bitwise the uninterrupted run; and what the run exports, loaded as a user loads it (PeftModel.from_pretrained on
weights/, transformers' from_pretrained on weights/merged/ and on weights/), gives the trained model's logits."""

import json
import sys

import pytest
import torch

from distrib.config import load_config
from distrib.models.adapters import base_name
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs
from tests.helpers.pretrained import SIZES, lora_llama, save_llama
from tests.helpers.processes import EVENT_S

COMMON = ["data.factory=tests.helpers.pretrained:token_dicts", "model.factory=tests.helpers.pretrained:lora_llama",
          "train.max_steps=6", "train.epochs=0", "train.global_batch_size=16", "train.optimizer=adamw",
          "train.lr=0.01", "train.weight_decay=0", "train.warmup_steps=1", "train.schedule=constant",
          "train.log_every=1", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0"]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SIGTERM_AT_3 = {"DISTRIB_TEST_DIE_AT": "3", "DISTRIB_TEST_DIE_SIGNAL": "SIGTERM", "DISTRIB_TEST_DIE_RANK": "1"}


def _trained(run_dir) -> dict[str, torch.Tensor]:
    """The whole wrapped state the run trained (model.pt)."""
    return torch.load(run_dir / "model.pt", weights_only=True)


def _adapter(state: dict) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if "lora_" in name}


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base folder, the one-process run, and the world-2 runs (fsdp, hsdp, stopped at step 3 then resumed)."""
    folder = tmp_path_factory.mktemp("adapters")
    base = save_llama(folder / "base")
    init = f"model.init_from={base}"
    run_training(load_config(None, [*COMMON, init, f"run.dir={folder / 'one'}"]))
    fsdp = [*COMMON, init, "dist.strategy=fsdp"]
    launched = launch_runs(TORCHRUN_2, [
        ("fsdp", {}, [*fsdp, f"run.dir={folder / 'fsdp'}"]),
        ("hsdp", {}, [*COMMON, init, "dist.strategy=hsdp", "dist.shard_size=1", f"run.dir={folder / 'hsdp'}"]),
        ("stopped", SIGTERM_AT_3, [*fsdp, f"run.dir={folder / 'stopped'}"]),
        ("rerun", {}, [*fsdp, f"run.dir={folder / 'stopped'}"])], folder, codes=folder / "codes.json")
    assert launched.returncode == 0, launched.stderr[-3000:]
    said = split_runs(launched.stderr, ["fsdp", "hsdp", "stopped", "rerun"])
    return folder, base, json.loads((folder / "codes.json").read_text()), said


@pytest.mark.timeout(EVENT_S)
def test_lora_trains_alike_under_ddp_fsdp_and_hsdp_and_leaves_the_base_bitwise(runs):
    from safetensors.torch import load_file

    folder, base, codes, said = runs
    assert codes == {"fsdp": 0, "hsdp": 0, "stopped": 75, "rerun": 0}, codes
    one = _trained(folder / "one")
    assert max(tensor.abs().max() for name, tensor in _adapter(one).items() if "lora_B" in name) > 1e-3  # it learnt
    for layout in ("fsdp", "hsdp"):
        other = _adapter(_trained(folder / layout))
        worst = max((other[name] - tensor).abs().max().item() for name, tensor in _adapter(one).items())
        assert worst < 1e-5, f"{layout}: adapter {worst:.2e} from one process"
    saved = load_file(base / "model.safetensors") if (base / "model.safetensors").exists() else {}
    for file in base.glob("*.safetensors"):
        saved.update(load_file(file))
    model = lora_llama()
    for layout in ("one", "fsdp", "hsdp"):
        state = _trained(folder / layout)
        frozen = {name: tensor for name, tensor in state.items() if base_name(model, name) is not None}
        assert len(frozen) == len(saved) and all(torch.equal(tensor, saved[base_name(model, name)])
                                                 for name, tensor in frozen.items()), layout
    assert "the adapter's 8 tensors" in said["fsdp"] and "keep the adapter's own initialisation" in said["fsdp"]
    flops = {layout: json.loads((folder / layout / "summary.json").read_text())["flops_per_sample"]
             for layout in ("one", "fsdp", "hsdp")}
    assert flops["one"] > 0 and len(set(flops.values())) == 1, flops  # the whole model's, frozen base included


@pytest.mark.timeout(EVENT_S)
def test_a_sigterm_and_the_same_command_again_are_bitwise_the_uninterrupted_run(runs):
    folder, _, codes, said = runs
    assert codes["stopped"] == 75 and "preempted at step 3" in said["stopped"], said["stopped"][-2000:]
    assert "resumed at step 3" in said["rerun"]
    whole, resumed = _trained(folder / "fsdp"), _trained(folder / "stopped")
    assert all(torch.equal(tensor, resumed[name]) for name, tensor in whole.items())


@pytest.mark.timeout(EVENT_S)
def test_the_exports_load_as_the_trained_model_for_a_user(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    folder, base, _, _ = runs
    ids = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(4))
    trained = lora_llama()
    trained.load_state_dict(_trained(folder / "fsdp"))
    expected = _logits(trained, ids)
    weights = folder / "fsdp" / "weights"
    loaded = {"PeftModel.from_pretrained(weights/)": PeftModel.from_pretrained(
                  LlamaForCausalLM.from_pretrained(base), weights),
              "from_pretrained(weights/merged/)": AutoModelForCausalLM.from_pretrained(weights / "merged"),
              "from_pretrained(weights/)": AutoModelForCausalLM.from_pretrained(weights)}
    assert (_logits(LlamaForCausalLM.from_pretrained(base), ids) - expected).abs().max() > 1e-4  # not the base
    for how, model in loaded.items():
        assert (_logits(model, ids) - expected).abs().max() < 1e-5, how
