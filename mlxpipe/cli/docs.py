"""The man page's OPTIONS section and the README's option table, made from :data:`.options.OPTIONS`.

``python -m mlxpipe.cli.docs`` rewrites the text between the marker comments in ``man/mlxpipe.1`` and
``README.md``; ``python -m mlxpipe.cli.docs --check`` only reports (exit 1) which of them is stale.
Everything outside the markers is written by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .options import GROUPS, OPTIONS, Option

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python -m mlxpipe.cli.docs"


@dataclass(frozen=True)
class Target:
    """A hand-written file with one generated region between two marker lines."""

    path: Path
    begin: str
    end: str
    render: Callable[[], str]

    def updated(self, text: str) -> str:
        """``text`` with the generated region replaced; ValueError when a marker is missing."""
        head, sep, rest = text.partition(self.begin + "\n")
        if not sep:
            raise ValueError(f"{self.path}: marker line {self.begin!r} not found")
        _, sep, tail = rest.partition(self.end + "\n")
        if not sep:
            raise ValueError(f"{self.path}: marker line {self.end!r} not found")
        return head + self.begin + "\n" + self.render() + self.end + "\n" + tail


def _roff(text: str) -> str:
    """Escape running text for man(7): backslashes, hyphens, and a leading dot or quote."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def _choices(opt: Option) -> str:
    return opt.allowed


def _grouped() -> list[tuple[str, list[Option]]]:
    """The options by group, in the order of GROUPS; groups without options left out."""
    groups = [(title, [o for o in OPTIONS if o.group == key]) for key, title in GROUPS.items()]
    return [(title, opts) for title, opts in groups if opts]


def man_options() -> str:
    """The OPTIONS section's body in man(7) macros, one subsection per group."""
    out: list[str] = []
    for title, opts in _grouped():
        out.append(f".SS {title}")
        for opt in opts:
            flags = ", ".join(f"\\fB{_roff(f)}\\fR" for f in opt.flags)
            metavar = f" \\fI{_roff(opt.metavar)}\\fR" if opt.metavar else ""
            out.append(".TP")
            out.append(flags + metavar)
            text = opt.help + _choices(opt) + (" " + opt.man if opt.man else "")
            out.append(_roff(text))
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def readme_options() -> str:
    """The README's option table in Markdown, one table per group."""
    out: list[str] = []
    for title, opts in _grouped():
        out += [f"**{title}**", "", "| Option | Meaning |", "|---|---|"]
        for opt in opts:
            sig = ", ".join(f"`{f}`" for f in opt.flags[:-1])
            sig += (", " if sig else "") + f"`{opt.name}" + (f" {opt.metavar}`" if opt.metavar else "`")
            out.append(f"| {sig} | {_md(opt.help + _choices(opt))} |")
        out.append("")
    return "\n".join(out) + "\n"


TARGETS = (
    Target(
        ROOT / "man" / "mlxpipe.1",
        f'.\\" BEGIN GENERATED OPTIONS: edit mlxpipe/cli/options.py, then run {REGENERATE}',
        '.\\" END GENERATED OPTIONS',
        man_options,
    ),
    Target(
        ROOT / "README.md",
        f"<!-- BEGIN GENERATED OPTIONS: edit mlxpipe/cli/options.py, then run {REGENERATE} -->",
        "<!-- END GENERATED OPTIONS -->",
        readme_options,
    ),
)


def stale() -> list[Path]:
    """The produced files whose generated region does not match :data:`OPTIONS`."""
    out = []
    for t in TARGETS:
        text = t.path.read_text(encoding="utf-8")
        if t.updated(text) != text:
            out.append(t.path)
    return out


def main(argv: list[str] | None = None) -> int:
    """Regenerate the files (or, with ``--check``, report the stale ones); return the exit status."""
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Regenerate the option docs.")
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        paths = stale()
        for path in paths:
            print(f"{path.relative_to(ROOT)} is stale: run {REGENERATE}", file=sys.stderr)
        return 1 if paths else 0
    for t in TARGETS:
        old = t.path.read_text(encoding="utf-8")
        new = t.updated(old)
        if new != old:
            t.path.write_text(new, encoding="utf-8")
            print(f"updated {t.path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
