"""The README documents every config key: each field of the config's sections is named in one of its tables."""

import dataclasses
import re

from distrib.config import Config
from tests.helpers.support import REPO

# A table row's first cell names one or more keys, e.g. `data.factory`, `data.kwargs`.
_ROW = re.compile(r"^\|([^|]*)\|")
_KEY = re.compile(r"`([a-z_]+)\.([a-z_]+)`")


def _config_keys() -> set[str]:
    return {f"{section.name}.{key.name}" for section in dataclasses.fields(Config)
            for key in dataclasses.fields(section.default_factory)}


def _readme_keys() -> set[str]:
    keys = set()
    for line in (REPO / "README.md").read_text().splitlines():
        row = _ROW.match(line)
        if row:
            keys |= {f"{section}.{key}" for section, key in _KEY.findall(row.group(1))}
    return keys


def test_every_config_key_is_in_a_readme_table():
    missing = sorted(_config_keys() - _readme_keys())
    assert not missing, f"config keys in no README table (add a row to a table under ## ...): {missing}"


def test_every_key_a_readme_table_names_is_a_config_key():
    sections = {section.name for section in dataclasses.fields(Config)}
    unknown = sorted(key for key in _readme_keys() - _config_keys() if key.split(".")[0] in sections)
    assert not unknown, f"README table rows naming no config key (renamed or removed?): {unknown}"
