"""The documentation stays true: generated parts current, options agree everywhere, a clean man page."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from mlxpipe import events
from mlxpipe.cli import docs

MAN = REPO / "man" / "mlxpipe.1"
README = REPO / "README.md"
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")


def between(text: str, begin: str, end: str) -> str:
    """The part of ``text`` from the line starting with ``begin`` to the next line starting with ``end``."""
    match = re.search(rf"^{re.escape(begin)}.*?$(.*?)^{re.escape(end)}", text, re.S | re.M)
    assert match, f"no {begin!r} ... {end!r} in the text"
    return match.group(1)


def help_flags() -> set[str]:
    r = run_cli(["--help"])
    assert r.returncode == 0
    assert r.stderr == b""
    option_lines = [line for line in r.stdout.decode().splitlines() if re.match(r"\s{2}-", line)]
    return {flag for line in option_lines for flag in FLAG.findall(line.split("  ")[1])}


def man_flags() -> set[str]:
    section = between(MAN.read_text(), ".SH OPTIONS", ".SH ")
    heads = re.findall(r"^\.TP\n(.*)$", section, re.M)
    return {f for head in heads for f in FLAG.findall(head.replace("\\-", "-").replace("\\fB", " "))}


def readme_flags() -> set[str]:
    table = between(README.read_text(), "<!-- BEGIN GENERATED OPTIONS", "<!-- END GENERATED OPTIONS")
    return {f for row in re.findall(r"^\| (.*?) \|", table, re.M) for f in FLAG.findall(row)}


def test_generated_regions_are_current() -> None:
    assert docs.stale() == [], "option docs are stale: run `python -m mlxpipe.cli.docs` (or `make docs`)"


def test_every_option_in_help_is_in_man_page_and_readme_and_back() -> None:
    in_help = help_flags()
    assert {"--max-tokens", "-n", "--jsonl", "--help", "--version"} <= in_help  # the parsing works
    for name, found in (("man page", man_flags()), ("README", readme_flags())):
        assert not in_help - found, f"in --help but not in the {name}: {sorted(in_help - found)}"
        assert not found - in_help, f"in the {name} but not in --help: {sorted(found - in_help)}"


def test_every_long_flag_the_man_page_mentions_exists() -> None:
    text = MAN.read_text().replace("\\-", "-")
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text))
    mentioned -= {"--hosts", "--backend", "--python"}  # mlx.launch's own, in the SYNOPSIS and EXAMPLES
    assert not mentioned - help_flags(), f"the man page names unknown options: {mentioned - help_flags()}"


def test_man_page_has_every_section_and_option_group() -> None:
    text = MAN.read_text()
    sections = re.findall(r'^\.SH "?([A-Z ]+?)"?$', text, re.M)
    for needed in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "INPUT FORMAT", "OUTPUT FORMAT"):
        assert needed in sections
    for needed in ("EXIT STATUS", "ENVIRONMENT", "EXAMPLES", "SEE ALSO"):
        assert needed in sections
    options = between(text, ".SH OPTIONS", ".SH ")
    for group in ("Input", "Generation", "Output", "Model"):
        assert f".SS {group}\n" in options
    for var in ("MLXPIPE_MODEL", "NO_COLOR", "XDG_CACHE_HOME"):
        assert f".B {var}\n" in between(text, ".SH ENVIRONMENT", ".SH ")
    for status in ("0", "1", "2", "3", "4", "130", "143"):
        assert f".B {status}\n" in between(text, '.SH "EXIT STATUS"', ".SH ")


def test_man_page_output_format_names_every_event_and_field() -> None:
    section = between(MAN.read_text(), '.SH "OUTPUT FORMAT"', ".SH ")
    named = set(re.findall(r"^\.BR? (\w+)", section, re.M))
    for cls in (events.Chunk, events.Done, events.Error, events.Summary):
        # Any value will do to learn the wire names: to_dict only copies (and rounds) the fields.
        sample = cls(**{f.name: 0 for f in dataclasses.fields(cls) if f.init})
        wire = set(sample.to_dict()) - {"event"}
        assert cls.kind in named, f"event {cls.kind!r} missing from OUTPUT FORMAT"
        assert not wire - named, f"{cls.kind} fields missing from OUTPUT FORMAT: {sorted(wire - named)}"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_renders_without_groff_warnings() -> None:
    r = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN)], capture_output=True, text=True)
    assert r.returncode == 0
    assert r.stderr == ""


def test_man_page_is_installed_with_the_package() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    # A wheel puts it in <venv>/share/man/man1; `make setup` links it there for an editable install.
    assert '"share/man/man1" = ["man/mlxpipe.1"]' in between(pyproject, "[tool.setuptools.data-files]", "[")


def _man_env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ, PATH=str(bin_dir) + os.pathsep + "/usr/bin:/bin")
    env.pop("MANPATH", None)
    return env


def _man_works(tmp_path: Path) -> str | None:
    """None when ``man -w`` finds a page beside a folder on PATH, as man-db does; else why not."""
    if shutil.which("man") is None:
        return "man is not installed"
    (tmp_path / "bin").mkdir()
    (tmp_path / "share" / "man" / "man1").mkdir(parents=True)
    (tmp_path / "share" / "man" / "man1" / "mlxpipe-probe.1").write_text(".TH PROBE 1\n")
    try:
        r = subprocess.run(
            ["man", "-w", "mlxpipe-probe"], capture_output=True, text=True, env=_man_env(tmp_path / "bin")
        )
    except OSError as exc:
        return f"man cannot run: {exc}"
    found = r.stdout.strip()
    if r.returncode != 0 or "\n" in found or len(found) > 1024 or not Path(found).is_file():
        # A minimized system's man is a stub that only says how to restore the manuals.
        said = (r.stdout.strip() or r.stderr.strip()).splitlines()
        return f"man does not find pages from PATH here ({said[0] if said else r.returncode})"
    return None


def test_man_finds_the_page_from_the_venv(tmp_path: Path) -> None:
    # man derives its search path from PATH (<dir>/../share/man): the venv's bin is enough.
    why_not = _man_works(tmp_path)
    if why_not:
        pytest.skip(why_not)
    env = _man_env(Path(sys.prefix) / "bin")
    r = subprocess.run(["man", "-w", "mlxpipe"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"`man mlxpipe` does not find the page from {sys.prefix}: run `make setup`"
    assert Path(r.stdout.strip()).read_text().count(".TH MLXPIPE 1 ") == 1


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("width", [50, 65, 80, 100])
def test_man_page_breaks_no_word_at_a_hyphen_it_adds(width: int) -> None:
    # `--tem-plate` or `$MLX-PIPE_MODEL` at a line end would be copied wrong: hyphenation is off.
    r = subprocess.run(
        ["groff", "-man", "-Tutf8", f"-rLL={width}n", str(MAN)], capture_output=True, text=True, check=True
    )
    broken = [line for line in r.stdout.splitlines() if re.search(r"\w\u2010$", line)]
    assert not broken, f"hyphenated at {width} columns: {broken}"


def test_man_page_names_the_packages_version() -> None:
    from mlxpipe import __version__

    assert re.search(rf'^\.TH MLXPIPE 1 \S+ "mlxpipe {re.escape(__version__)}"', MAN.read_text(), re.M)


def test_man_page_xargs_examples_pass_names_safely() -> None:
    # NUL-separated names, handed to `sh -c` as an argument: never spliced into the shell's code.
    examples = [line for line in MAN.read_text().splitlines() if "xargs" in line and "mlxpipe" in line]
    assert examples
    for line in examples:
        assert "\\-0" in line and "{}" not in line, line
