"""An adapter run's export, in one process: weights/ in peft's own format and weights/merged/ load back, as a user
loads them (PeftModel.from_pretrained, transformers' from_pretrained on either folder), as the trained model; the
export's self-check catches a file that lost a tensor; an adapter-only weights/ is refused by eval in one line, and
weights/merged/ given to eval is the model it evaluates, the trained one."""

from __future__ import annotations

import json

import pytest
import torch

from distrib.checkpoint.adapter_weights import ADAPTER_CONFIG, MERGED_DIR  # noqa: E402
from distrib.checkpoint.export_check import ExportCheckError  # noqa: E402
from distrib.checkpoint.run_weights import write_run_weights  # noqa: E402
from distrib.checkpoint.weight_files import ADAPTER_FILE, WEIGHTS_DIR  # noqa: E402
from distrib.distributed.strategies.ddp import DDPStrategy  # noqa: E402
from distrib.errors import UserError  # noqa: E402
from tests.helpers.pretrained import SIZES, lora_llama, save_llama  # noqa: E402

TOKENS = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))


def _trained(base_folder, fan_in_fan_out=False):
    """A LoRA Llama (r=4 on q_proj, v_proj) on the saved base, its adapter weights made non-zero as training does."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = lora_llama()
    base = AutoModelForCausalLM.from_pretrained(str(base_folder))
    wrapped = model.get_base_model()
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            target = wrapped.get_submodule(name.rsplit(".", 1)[0])
            target = getattr(target, "base_layer", target)
            getattr(target, name.rsplit(".", 1)[1]).copy_(tensor)
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.2)
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter")
    base = save_llama(folder / "base")
    model = _trained(base)
    lines = []
    written = write_run_weights(model, None, folder / "run", 0, DDPStrategy(), str(base), True, lines.append)
    return folder, base, model, written, lines


def test_weights_hold_the_adapter_in_peft_format_and_merged_the_base_names(exported):
    folder, base, _, written, lines = exported
    weights = folder / "run" / WEIGHTS_DIR
    assert sorted(p.name for p in weights.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG, MERGED_DIR])
    config = json.loads((weights / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["inference_mode"] is True
    from safetensors import safe_open

    with safe_open(str(weights / ADAPTER_FILE), framework="pt") as handle:
        names = list(handle.keys())
    assert len(names) == 2 * 2 * SIZES["num_hidden_layers"] and all("lora_" in n and "default" not in n for n in names)
    with safe_open(str(weights / MERGED_DIR / "model.safetensors"), framework="pt") as handle:
        merged = set(handle.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in merged and not any("lora" in n or "base_" in n for n in merged)
    whole = torch.load(folder / "run" / "model.pt", weights_only=True)  # written by rank 0 itself, one file at a time
    assert written == ["model.pt"] and any("base_model.model." in n for n in whole)  # the wrapped state
    assert len(lines) == 1 and "merged" in lines[0] and "from_pretrained" in lines[0]


def test_each_way_a_user_loads_the_export_gives_the_trained_logits(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, base, model, _, _ = exported
    weights = folder / "run" / WEIGHTS_DIR
    expected = _logits(model)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(weights))
    merged = AutoModelForCausalLM.from_pretrained(str(weights / MERGED_DIR))
    transformers_own = AutoModelForCausalLM.from_pretrained(str(weights))  # the base through adapter_config.json
    for loaded in (adapter, merged, transformers_own):
        assert (_logits(loaded.eval()) - expected).abs().max() < 1e-5
    assert (_logits(AutoModelForCausalLM.from_pretrained(str(base)).eval()) - expected).abs().max() > 1e-3


def test_the_merge_is_peft_merge_and_unload_for_fan_in_fan_out_and_bias_too(tmp_path):
    """GPT-2's Conv1D (fan_in_fan_out) with a LoRA bias: merged/ equals peft's own merge_and_unload, bitwise."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                               lora_bias=True))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.2)
    write_run_weights(model, None, tmp_path, 0, DDPStrategy(), "", True)
    merged = load_file(tmp_path / WEIGHTS_DIR / MERGED_DIR / "model.safetensors")
    reference = model.merge_and_unload().state_dict()
    assert all(torch.equal(merged[name], reference[name]) for name in merged)
    assert set(reference) - {"lm_head.weight"} == set(merged)  # lm_head: tied to the embedding, stored once


def test_the_self_check_catches_an_adapter_file_that_lost_a_tensor(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from distrib.checkpoint.export_check import check_adapter_folder

    folder, _, model, _, _ = exported
    broken = tmp_path / "broken"
    broken.mkdir()
    state = load_file(folder / "run" / WEIGHTS_DIR / ADAPTER_FILE)
    first = next(iter(state))
    save_file({name: tensor for name, tensor in state.items() if name != first}, broken / ADAPTER_FILE)
    with pytest.raises(ExportCheckError, match=r"1 missing \(first base_model\.model\..*\.default.*distrib's bug"):
        check_adapter_folder(broken, model, "default")


def test_the_self_check_catches_a_merged_folder_that_lost_a_tensor(exported, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from distrib.checkpoint.export_check import architecture, check_pretrained_folder

    folder, _, model, _, _ = exported
    broken = tmp_path / "merged"
    shutil.copytree(folder / "run" / WEIGHTS_DIR / MERGED_DIR, broken)
    state = load_file(broken / "model.safetensors")
    save_file({n: t for n, t in state.items() if n != "model.norm.weight"}, broken / "model.safetensors")
    with pytest.raises(ExportCheckError, match=r"merged: .*1 missing \(first model\.norm\.weight\)"):
        check_pretrained_folder(broken, architecture(broken, model.get_base_model()))


def test_eval_refuses_an_adapter_only_weights_folder_in_one_line(exported, tmp_path):
    import shutil

    from distrib.training.trained import _read_safetensors

    folder = tmp_path / WEIGHTS_DIR
    shutil.copytree(exported[0] / "run" / WEIGHTS_DIR, folder)
    with pytest.raises(UserError, match=r"the adapter alone .*PeftModel\.from_pretrained") as error:
        _read_safetensors(folder)
    assert "\n" not in str(error.value)


def test_eval_of_the_merged_folder_rebuilds_the_trained_model_from_it(exported):
    """`distrib eval RUN/weights/merged`: the run's config (a peft factory) builds the model, merged into its base,
    which takes the folder's weights: the trained logits; eval.json goes into the run, not into the export."""
    from distrib.config import load_config, write_resolved
    from distrib.data.text import token_info
    from distrib.training.trained import load_trained, rebuilt_model

    folder, _, model, _, _ = exported
    run = folder / "run"
    write_resolved(load_config(None, ["model.factory=tests.helpers.pretrained:lora_llama", "data.name=tokens",
                                      f"data.vocab_size={SIZES['vocab_size']}"]), run)
    trained = load_trained(str(run / WEIGHTS_DIR / MERGED_DIR))
    assert trained.source == run / WEIGHTS_DIR / MERGED_DIR and trained.out_dir == run
    rebuilt = rebuilt_model(trained, token_info("tokens", 12, SIZES["vocab_size"])).eval()
    assert type(rebuilt).__name__ == "LlamaForCausalLM"
    assert (_logits(rebuilt) - _logits(model)).abs().max() < 1e-5
    with pytest.raises(UserError, match=r"weights: a peft adapter alone, not a whole model, so distrib eval cannot "
                                        r"evaluate it; give .*run \(its model.pt\) or .*weights/merged$"):
        load_trained(str(run / WEIGHTS_DIR))
