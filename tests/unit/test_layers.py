"""Imports point one way: every `import distrib...` in every module of distrib/ (also those inside functions and under
TYPE_CHECKING) goes to the importer's own package or to a lower layer of the order in docs/how-it-works.md, so a low
layer never needs a high one and no two packages import each other."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.processes import REPO

# Highest first: cli/api > worker > training > checkpoint, metrics > models > data > distributed > launch >
# config, errors, factory. Peers on one line do not import each other; `python -m distrib` (__main__) runs the cli;
# plan (distrib plan) sizes a run as the worker would build it, so it sits beside the worker; of the lowest three,
# config and factory raise errors' exceptions, so errors sits one step below them; config_reference (distrib config,
# docs/config.md) reads only the config, beside launch. integrations (Ray Train)
# runs what the CLI and fit run. launch_env (the variables the launcher writes and the runtime reads) and
# torch_private (what torch keeps private) import nothing of distrib, so they sit at the bottom with errors.
LAYERS = (("__main__",), ("integrations",), ("__init__", "cli", "api"), ("worker", "plan"), ("training",),
          ("checkpoint", "metrics"), ("models",), ("data",), ("distributed",), ("launch", "config_reference"),
          ("config", "factory"), ("errors", "launch_env", "torch_private"))
RANK = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}


def _unit(module: str) -> str:
    """distrib.training.trainer -> training, distrib.api -> api, distrib -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _submodule(base: str, name: str) -> str:
    """`from base import name`: base.name where that is a module or package of distrib, else base."""
    path = REPO.joinpath(*base.split("."), name)
    return f"{base}.{name}" if path.is_dir() or path.with_suffix(".py").is_file() else base


def _imports(path: Path, module: str):
    """(line, imported distrib module) for every import of distrib in one file, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "distrib")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
            if base.split(".")[0] == "distrib":
                # `from distrib import launch` imports the package launch, `from distrib import fit` distrib itself.
                yield from ((node.lineno, _submodule(base, a.name)) for a in node.names)


def _modules():
    for path in sorted((REPO / "distrib").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_package_is_in_a_layer():
    units = {_unit(module) for _, module in _modules()}
    assert units == set(RANK), f"packages without a layer: {units - set(RANK)}; layers without a package: " \
                               f"{set(RANK) - units}"


def test_imports_point_down_the_layers():
    wrong = []
    for path, module in _modules():
        here = _unit(module)
        for line, target in _imports(path, module):
            there = _unit(target)
            if there != here and RANK[there] >= RANK[here]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {module} imports {target} ({here} may not import "
                             f"{there})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself can fail: an import of the trainer from data is named with its file and line."""
    path = tmp_path / "idx.py"
    path.write_text("import torch\n\n\ndef f():\n    from ..training.trainer import Trainer\n    return Trainer\n")
    found = list(_imports(path, "distrib.data.idx"))
    assert found == [(5, "distrib.training.trainer")]
    assert RANK[_unit(found[0][1])] > RANK["data"]
