"""distrib.torch_private: every private torch and torchft name it gives loads and acts as distrib uses it, so that a
torch release that moves one fails here, naming it; and no other module of distrib names one."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import tokenize
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distrib import torch_private
from distrib.plan import fake_process_group

PACKAGE = Path(torch_private.__file__).parent
# What only distrib/torch_private.py may write: a private torch module or name (in code or a string, such as a
# logger's name), a private name imported from a public module, torchft's private extension, and the private
# members of torch's objects that distrib reads (nn.Module's _parameters, _buffers and _modules and torch.compile's
# _orig_mod are used in place: torch_private's docstring says why).
PRIVATE_USE = re.compile(r"\btorch(\.\w+)*\._[A-Za-z]|\bfrom torch[\w.]* import .*\b_[A-Za-z]|\btorchft\._"
                         r"|\bnn\.modules\.\w+\._|\._(flatten|concatenate|cdata|base|compiled_call_impl)\b"
                         r"|_AsyncCheckpointProcess|_CHECKPOINT_PROCESS\b")


@pytest.mark.parametrize("name", sorted(torch_private.PRIVATE))
def test_each_private_name_loads(name):
    module, attribute = torch_private.PRIVATE[name]
    try:
        value = getattr(torch_private, name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch moved {module}.{attribute} (distrib.torch_private.{name}): {e}")
    assert value is getattr(importlib.import_module(module), attribute)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        torch_private.no_such_name


def test_the_checkpoint_process_base_has_what_its_subclass_takes():
    base = torch_private.AsyncCheckpointProcess
    source = inspect.getsource(base.__init__)
    for member in torch_private.CHECKPOINT_PROCESS_MEMBERS:
        assert hasattr(base, member) or f"self.{member}" in source, \
            f"torch's _AsyncCheckpointProcess no longer has {member} (distrib.checkpoint.process.CheckpointProcess)"
    assert hasattr(torch_private.CheckpointSaveProcessControlOpts, "INIT_COMPLETE")
    assert hasattr(torch_private.CheckpointSaveProcessControlOpts, "TERMINATE")


def test_the_checkpoint_process_global_is_set_and_read_back():
    before = torch_private.checkpoint_process()
    marker = object()
    try:
        torch_private.set_checkpoint_process(marker)
        assert torch_private.checkpoint_process() is marker
    finally:
        torch_private.set_checkpoint_process(before)


def test_meshes_flatten_and_concatenate_and_dtensor_plans_are_forgotten():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "a", "b"))
        flat = torch_private.flatten_mesh(mesh["a", "b"], "shard")
        assert flat.size() == 4 and flat.mesh_dim_names == ("shard",)
        joined = torch_private.concatenate_meshes([mesh["replicate"], flat])
        assert joined.mesh_dim_names == ("replicate", "shard") and joined.mesh.tolist() == [[0, 1, 2, 3],
                                                                                             [4, 5, 6, 7]]
        torch_private.forget_dtensor_plans()


def test_storages_views_and_in_place_compile():
    whole = torch.arange(6.0)
    view = whole[2:]
    assert torch_private.storage_id(view) == torch_private.storage_id(whole) != torch_private.storage_id(view.clone())
    assert torch_private.view_base(view) is whole and torch_private.view_base(whole) is None
    module = nn.Linear(2, 2)
    assert not torch_private.compiled_in_place(module)
    module.compile()  # compiles at the first forward: nothing is traced here
    assert torch_private.compiled_in_place(module)


def test_the_fake_backend_is_registered():
    torch_private.register_fake_backend()
    assert "fake" in dist.Backend.backend_list


def test_the_redistribute_logger_is_dtensors():
    module = importlib.import_module(torch_private.REDISTRIBUTE_LOGGER)
    assert getattr(module, "logger", None) is logging.getLogger(torch_private.REDISTRIBUTE_LOGGER)


def test_the_lighthouse_server_is_torchfts():
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer  # its public home

    assert torch_private.lighthouse_server_class() is LighthouseServer


def test_no_other_module_names_a_private_torch_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(torch_private.__file__):
            continue
        lines = path.read_text().splitlines()
        with tokenize.open(path) as source:  # comments may name them: only code and strings count
            for token in tokenize.generate_tokens(source.readline):
                if token.type == tokenize.COMMENT:
                    row, column = token.start
                    lines[row - 1] = lines[row - 1][:column]
        found += [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
                  for number, line in enumerate(lines, 1) if PRIVATE_USE.search(line)]
    assert not found, "private torch names outside distrib/torch_private.py:\n" + "\n".join(found)
