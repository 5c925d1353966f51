"""The docs hold: README.md (at most 250 lines, the two set-up commands, an index of docs/) and every page in docs/.
Every relative link resolves, file and #heading (GitHub's slugs). Every ```bash and ```python block parses (bash -n,
distrib's own parser for `distrib ...`, torchrun's for `distrib launch`/`torchrun`, ast for Python) and runs here
unless its info string says what it needs that a test machine lacks (docs/development.md, "The docs' examples")."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from distrib import cli
from distrib.cli.parser import parser
from distrib.errors import UserError
from tests.helpers.support import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Why a block only parses: what it needs that a test machine lacks, or costs more than the unit lane affords.
NEEDS = {"gpu", "cluster", "download", "files", "launch", "slow"}
CHECKED = {"bash", "python"}
SETUP = ("apt-get update && apt-get install -y dataset-fashion-mnist && python3 -m pip install -e '.[dev]' "
         "torch==2.14.1 torchvision==0.29.1 && distrib train",
         "python3 -m pip install -e '.[dev]' torch==2.14.1 torchvision==0.29.1 && python3 -m ruff check . && "
         "python3 -m pytest")
# What a `distrib train` of a block that runs here gets appended: two steps, its own folder, no bar.
SHORT_TRAIN = ("train.max_steps=2", "run.progress=false")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    marks: tuple[str, ...]
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^```(\S*)\s*(.*)$", lines[index])
        if opening:
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            found.append(Block(page, index + 1, opening.group(1), tuple(opening.group(2).split()),
                               "\n".join(lines[index + 1:end]) + "\n"))
            index = end
        index += 1
    return found


def _prose(page: Path) -> str:
    """The page without its fenced blocks and inline code: where headings and links are."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


BLOCKS = [block for page in PAGES for block in _blocks(page)]
CODE = [block for block in BLOCKS if block.language in CHECKED]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        name, count = base, 1
        while name in found:  # GitHub numbers repeated headings: name, name-1, name-2
            name, count = f"{base}-{count}", count + 1
        found.add(name)
    return found


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(page))


def test_the_readme_is_short_has_the_set_up_commands_and_indexes_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for command in SETUP:
        assert f"\n{command}\n" in readme, f"the set-up command changed: {command}"
    ci = (REPO / ".ci" / "run").read_text()  # CI runs the README's test command, its install quiet
    assert SETUP[1].replace(" && python3 -m ruff", "\npython3 -m ruff").replace("install -e", "install -q -e") in ci
    linked = {link.split("#")[0] for link in _links(REPO / "README.md")}
    assert {f"docs/{page.name}" for page in PAGES[1:]} <= linked, "a docs/ page the README's index does not link"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda page: page.name)
def test_every_page_opens_with_what_it_covers(page):
    paragraphs = page.read_text().split("\n\n")
    assert paragraphs[0].startswith("# ") and "\n" not in paragraphs[0], f"{page.name}: a title line first"
    assert not paragraphs[1].startswith(("#", "|", "```", "-")), f"{page.name}: then a paragraph of what it covers"


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and (target.suffix != ".md" or anchor not in anchors(target)):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves_file_and_heading(page):
    assert not broken_links(page), f"{page.name}: {broken_links(page)}"


def test_a_broken_link_is_found_and_slugs_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## In: `model.init_from = PATH`\n\n## Again\n\n## Again\n\n"
                    "```bash\n# not a heading\n```\n\n"
                    "[ok](#in-modelinit_from--path) [ok](#again-1) [no](#not-a-heading) [no](gone.md) `[no](x.md)`\n")
    assert broken_links(page) == ["#not-a-heading: no heading #not-a-heading in page.md",
                                  f"gone.md: no file {tmp_path / 'gone.md'}"]
    assert slug("Sharded training: `ddp`, `fsdp` or `hsdp`") == "sharded-training-ddp-fsdp-or-hsdp"


def test_every_example_says_whether_it_runs_here():
    unknown = [f"{block.where}: {mark}" for block in CODE for mark in block.marks
               if mark not in NEEDS and not mark.startswith("tested-by=")]
    assert not unknown, f"info-string words that are not a need ({sorted(NEEDS)}) or tested-by=PATH: {unknown}"
    for block in CODE:
        for mark in block.marks:
            if mark.startswith("tested-by="):
                test = REPO / mark.removeprefix("tested-by=")
                page = "README" if block.page.name == "README.md" or block.body.strip() in SETUP else block.page.name
                assert test.is_file() and page in test.read_text(), \
                    f"{block.where}: {mark} must name a file that reads {page}"


def test_shell_blocks_are_bash():
    """One bash -n over every block, each wrapped in a function of its own, so an error's line names its block."""
    script, starts = [], []
    for block in (b for b in CODE if b.language == "bash"):
        starts.append((len(script) + 2, block))
        script += [f"__block_{len(starts)}() {{", *block.body.splitlines(), ":", "}"]
    done = subprocess.run(["bash", "-n"], input="\n".join(script) + "\n", capture_output=True, text=True)
    if done.returncode:
        line = int(re.search(r"line (\d+)", done.stderr).group(1))
        start, block = max((s, b) for s, b in starts if s <= line)
        pytest.fail(f"{block.where} + {line - start}: {done.stderr.strip()}")


@pytest.mark.parametrize("block", [b for b in CODE if b.language == "python"], ids=lambda b: b.where)
def test_python_blocks_parse(block):
    ast.parse(block.body, filename=block.where)


def commands(body: str) -> list[list[str]]:
    """Each simple command of a shell block as its words: continuations joined, comments, environment assignments
    and redirections dropped, `&&`, `||`, `;` and `|` splitting commands."""
    lexer = shlex.shlex(body.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    found, words, redirect = [], [], False
    for token in [*lexer, ";"]:
        if token in ("&&", "||", ";", "|", "\n") or token == "":
            found += [words] if words else []
            words = []
        elif token in (">", ">>", "<"):
            redirect = True
        elif redirect:
            redirect = False
        elif words or not re.match(r"^[A-Z_]+=", token):
            words.append(token)
    return found


def _lines(body: str) -> list[str]:
    """The block's lines, continuations joined: shlex above does not split on newlines."""
    return [line for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def block_commands(block: Block) -> list[list[str]]:
    return [words for line in _lines(block.body) for words in commands(line)]


def _parse(parser_parse, argv: list[str], where: str) -> argparse.Namespace:
    try:
        return parser_parse(argv)
    except UserError as e:  # distrib's parsers and torchrun's under distrib launch: one line, no usage text
        pytest.fail(f"{where}: {' '.join(argv)}: {e}")


def _torchrun(argv: list[str], where: str) -> None:
    from distrib.launch.arguments import parse_args

    args = _parse(parse_args, argv, where)
    if args.module and args.training_script == "distrib":
        _distrib(args.training_script_args, where)
    elif not args.module and args.training_script.startswith(("scripts/", "tests/")):
        assert (REPO / args.training_script).is_file(), f"{where}: no script {args.training_script}"


def _distrib(argv: list[str], where: str) -> None:
    if argv[:1] == ["launch"]:
        _torchrun(argv[1:], where)
    else:
        _parse(parser().parse_args, argv, where)


def check_command(words: list[str], where: str) -> None:
    """A command of the docs through the parser that reads it; scripts of the repository exist."""
    program, args = words[0], words[1:]
    if program in ("python", "python3") and args[:2] == ["-m", "distrib"]:
        _distrib(args[2:], where)
    elif program == "distrib":
        _distrib(args, where)
    elif program == "torchrun":
        _torchrun(args, where)
    elif program == "sbatch":  # sbatch [options] scripts/slurm/train.sbatch CONFIG [trainer args]
        script = next(i for i, word in enumerate(args) if word.endswith(".sbatch"))
        assert (REPO / args[script]).is_file(), f"{where}: no batch script {args[script]}"
        _distrib(["train", "--config", *args[script + 1:]], where)
    elif program in ("python", "python3", "bash") and args and args[0].startswith(("scripts/", "tests/")):
        assert (REPO / args[0]).is_file(), f"{where}: no script {args[0]}"


@pytest.mark.parametrize("block", [b for b in CODE if b.language == "bash"], ids=lambda b: b.where)
def test_shell_commands_parse(block):
    for words in block_commands(block):
        check_command(words, block.where)


def test_the_parsers_refuse_what_they_should():
    """The checks above can fail: a misspelt flag of distrib train, of torchrun, after `-m distrib` and after sbatch's
    script; and the shell words are what the shell would pass."""
    for argv in (["distrib", "train", "--sett", "x=1"], ["torchrun", "--nproc-per-node", "2", "--no-such-flag", "s.py"],
                 ["distrib", "launch", "-m", "distrib", "train", "--nosuch"],
                 ["sbatch", "scripts/slurm/train.sbatch", "c.toml", "--nosuch"]):
        with pytest.raises(pytest.fail.Exception):
            check_command(argv, "self-test")
    assert commands("A=1 distrib train --set 'a.b=[1, 2]' > x && wandb sync  # c") == \
        [["distrib", "train", "--set", "a.b=[1, 2]"], ["wandb", "sync"]]


# Each example that runs here, once: the same block on two pages (the quick start's first command) runs once.
RUN_HERE = list({(block.language, block.body): block for block in reversed(CODE) if not block.marks}.values())


@pytest.mark.parametrize("block", RUN_HERE, ids=lambda b: b.where)
def test_examples_without_a_need_run_here(block, tmp_path, monkeypatch):
    """Python as written, in a fresh folder; shell commands through distrib.cli.main, `distrib train` for 2 steps."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    if block.language == "python":
        exec(compile(block.body, block.where, "exec"), {"__name__": "__docs__"})
        return
    for number, line in enumerate(_lines(block.body)):
        for words in commands(line):
            assert words[0] == "distrib", f"{block.where}: {' '.join(words)} cannot run here: mark what it needs"
            argv = words[1:]
            if argv[0] == "train":
                argv += [arg for item in (*SHORT_TRAIN, f"run.dir=run_{number}") for arg in ("--set", item)]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert cli.main(argv) == 0, f"{block.where}: {' '.join(words)}"
            target = re.search(r"\s>\s*([^\s#]+)", line)
            if target:
                (tmp_path / target.group(1)).write_text(out.getvalue())
