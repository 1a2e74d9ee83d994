"""The rooms keep their walls: only the engine runs mlx-lm, and the command line starts without mlx."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import REPO, cli_env

PACKAGE = REPO / "mlxpipe"


def imported_modules(path: str) -> set[str]:
    tree = ast.parse((PACKAGE / path).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_engine_imports_mlx_lm() -> None:
    users = {
        p.name
        for p in PACKAGE.glob("*.py")
        if any(m == "mlx_lm" or m.startswith("mlx_lm.") for m in imported_modules(p.name))
    }
    assert users <= {"engine.py"}, f"mlx_lm imported outside engine.py: {sorted(users - {'engine.py'})}"


def test_the_command_line_starts_without_importing_mlx() -> None:
    # --help, --version and usage errors must be instant: mlx is imported only once a model is needed.
    code = (
        "import sys, mlxpipe.cli, mlxpipe.docs, mlxpipe.term\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
