"""What the CLI says about a path or about itself is true (issue 29 item 5): a file is called a file, a missing
folder a missing folder, and `reproduce --help` does not say both "nothing is launched" and "then runs them".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.cli import app

REPO = Path(__file__).resolve().parent.parent
DUMPS = sorted(str(p) for p in (REPO / "tests" / "fixtures" / "stacks").glob("gloo3_faulthandler_rank*.txt"))
runner = CliRunner()


def _run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args), env={"COLUMNS": "400"})
    return r.exit_code, r.output


@pytest.mark.parametrize("name,make,words", [
    ("afile", lambda p: p.write_text("x"), "afile is a file, not a folder"),
    ("fifo", lambda p: os.mkfifo(p), "fifo is a FIFO (named pipe), not a folder"),
    ("nodir", lambda p: None, "nodir does not exist:"),
    ("afile/sub", lambda p: p.parent.write_text("x"), "afile/sub does not exist ("),
], ids=["a file", "a fifo", "missing", "under a file"])
def test_cleanup_says_what_the_path_is(tmp_path: Path, name, make, words):
    p = tmp_path / name
    make(p)
    code, out = _run("cleanup", str(p))
    assert code == 2 and words in out, out
    assert "processes.json not found" not in out  # the breaker's case: said of a file, as if it were a folder


def test_cleanup_under_a_file_names_the_file(tmp_path: Path):
    (tmp_path / "afile").write_text("x")
    code, out = _run("cleanup", str(tmp_path / "afile" / "sub"))
    assert code == 2 and f"({tmp_path / 'afile'} is a file, not a folder)" in out, out


@pytest.mark.parametrize("where", ["afile/x.md", "afile/deeper/x.md"])
def test_markdown_under_a_file_says_the_file_is_a_file(tmp_path: Path, where):
    (tmp_path / "afile").write_text("x")
    code, out = _run("analyze", *DUMPS, "--markdown", str(tmp_path / where))
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in out and "does not exist" not in out, out


def test_reproduce_help_says_what_it_launches_and_when():
    code, out = _run("reproduce", "--help")
    text = re.sub(r"[\s│]+", " ", out)
    assert code == 0
    assert "Nothing is launched" not in text and "nothing is launched" not in text.split("--no-run", 1)[0], text
    assert "with --no-run: only write it, launch nothing" in text  # --no-run: nothing launched
    assert "Without --no-run (the default) it launches one server" in text  # else: it runs them


def _option_help(verb: str, option: str) -> str:
    import typer.main

    cmd = typer.main.get_command(app).commands[verb]
    return next(p.help for p in cmd.params if option in p.opts)


@pytest.mark.parametrize("verb,option", [("run", "--expect"), ("compare", "--expect-before"),
                                         ("compare", "--expect-after")])
def test_expect_help_names_every_word_the_cli_accepts(verb, option):
    """`compare --help` said '--expect-before … deadlock | success | inconclusive' while the CLI accepts desync
    (README's compare synopsis lists it): the help is built from repro.verdict.EXPECT_WORDS."""
    from repro.verdict import EXPECT_WORDS

    text = _option_help(verb, option)
    for word in EXPECT_WORDS:
        assert word in text, (verb, option, word)


def test_readme_command_table_gives_demo_its_release_option():
    """README's command table showed `repro demo [--python PATH] …` without --release, which `demo --help` has."""
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `repro demo "))
    assert _option_help("demo", "--release")  # the option exists (StopIteration if not)
    assert "--release V" in row
