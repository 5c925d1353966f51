"""The config reference, rendered from the one source of each key's meaning (its `key()` in distrib.config): the page
docs/config.md, `distrib config [SECTION]` in the terminal, and `distrib config --toml`, a complete commented file."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass

from distrib.config import Config, ConfigError, _suggest, _toml_value

PAGE_HEAD = """# Config reference

Every key of a run's config: its type, default, meaning and allowed values. A TOML file in `configs/` sets any of
them by section (`[train]`, then `lr = 0.1`); `--set section.key=value` overrides one on the command line. The
same reference prints in the terminal with `distrib config [SECTION]`; `distrib config --toml` writes a complete,
commented config of the defaults that `distrib train --config` reads back unchanged.

This page is generated from `distrib/config.py` (`python -m distrib config --markdown > docs/config.md`); a test
fails when it is stale.
"""


@dataclass(frozen=True, slots=True)
class Key:
    section: str
    name: str
    type: str
    default: object
    doc: str
    choices: tuple

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    def default_text(self) -> str:
        return _toml_value(self.default)


def sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}


def keys(section: str | None = None) -> list[Key]:
    """Every key, in the order the config declares them; one section's when named."""
    chosen = sections()
    if section is not None:
        if section not in chosen:
            raise ConfigError(f"distrib config {section}: unknown section; {_suggest(section, chosen)}")
        chosen = {section: chosen[section]}
    found = []
    for name, cls in chosen.items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            found.append(Key(name, f.name, str(f.type), getattr(defaults, f.name), f.metadata["doc"],
                             f.metadata["choices"]))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/config.md: a table per section."""
    lines = [PAGE_HEAD]
    for section in sections():
        lines += [f"## `[{section}]`", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for item in keys(section):
            allowed = f" Allowed: {', '.join(f'`{c}`' for c in item.choices)}." if item.choices else ""
            lines.append(f"| `{item.dotted}` | `{_cell(item.type)}` | `{_cell(item.default_text())}` | "
                         f"{_cell(item.doc)}.{allowed} |")
        lines.append("")
    return "\n".join(lines)


def text(section: str | None = None, width: int = 100) -> str:
    """The terminal form: each key with its type and default, its meaning indented below."""
    lines = []
    for item in keys(section):
        lines.append(f"{item.dotted} = {item.default_text()}  ({item.type})")
        body = item.doc + (f". Allowed: {', '.join(map(str, item.choices))}" if item.choices else "")
        lines += textwrap.wrap(body, width=width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"


def toml() -> str:
    """A complete config of the defaults, each key under its meaning as a comment."""
    lines = ["# distrib's config, every key at its default (distrib config --toml).",
             "# Train with it: distrib train --config THIS_FILE"]
    for section in sections():
        lines += ["", f"[{section}]"]
        for item in keys(section):
            body = item.doc + (f". Allowed: {', '.join(map(str, item.choices))}" if item.choices else "")
            lines += textwrap.wrap(body, width=118, initial_indent="# ", subsequent_indent="# ")
            lines.append(f"{item.name} = {item.default_text()}")
    return "\n".join(lines) + "\n"
