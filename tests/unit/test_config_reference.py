"""One source for every config key's meaning: docs/config.md, `distrib config [SECTION]` and `distrib config --toml`
all come from the fields' key() in distrib/config.py, and the page is not stale."""

import dataclasses
from pathlib import Path

import pytest

from distrib import cli, config_reference
from distrib.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]


def _fields() -> list[tuple[str, str, object]]:
    defaults = Config()
    return [(section.name, f.name, getattr(getattr(defaults, section.name), f.name))
            for section in dataclasses.fields(Config) for f in dataclasses.fields(section.default_factory)]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["config", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_page_is_generated_from_the_config():
    page = (REPO / "docs" / "config.md").read_text()
    assert page == config_reference.markdown(), \
        "docs/config.md is stale: python -m distrib config --markdown > docs/config.md"


def test_every_key_has_a_meaning_and_appears_with_its_default_on_the_page_and_in_the_terminal(capsys):
    page = (REPO / "docs" / "config.md").read_text()
    code, terminal, _ = _cli(capsys)
    assert code == 0
    for section, name, default in _fields():
        item = next(k for k in config_reference.keys(section) if k.name == name)
        assert len(item.doc) > 10, f"{section}.{name} has no meaning in its key()"
        shown = config_reference.Key(section, name, "", default, "", ()).default_text()
        assert f"| `{section}.{name}` | " in page and f"| `{shown}` |" in page
        assert f"{section}.{name} = {shown}  (" in terminal


def test_one_section_prints_only_its_keys(capsys):
    code, out, _ = _cli(capsys, "train")
    keys = [line.split(" = ")[0] for line in out.splitlines() if not line.startswith(" ")]
    assert code == 0 and keys == [f"train.{name}" for section, name, _ in _fields() if section == "train"]


def test_an_unknown_section_is_one_line(capsys):
    code, out, err = _cli(capsys, "trian")
    assert code == 2 and not out
    assert err.strip().splitlines() == ["distrib: error: distrib config trian: unknown section; did you mean 'train'?"]


@pytest.mark.parametrize("overrides", [(), ("train.lr=0.1",)])
def test_the_toml_form_resolves_to_the_defaults(capsys, tmp_path, overrides):
    code, out, _ = _cli(capsys, "--toml")
    path = tmp_path / "c.toml"
    path.write_text(out)
    assert code == 0 and out.count("\n# ") > 95  # every key under its comment
    assert load_config(str(path), overrides) == load_config(None, overrides)


def test_allowed_values_are_the_ones_validation_checks():
    with pytest.raises(Exception, match="must be one of auto, cpu, cuda"):
        load_config(None, ["dist.device=tpu"])
    page = config_reference.markdown()
    assert "Allowed: `auto`, `cpu`, `cuda`." in page
