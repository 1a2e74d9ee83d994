"""The rooms keep their walls: ARCHITECTURE.md's table is true, only the engine runs mlx-lm, mlx always comes
after the BLAS, no two modules import each other, the command line starts without mlx, and no class or
function outgrows one reading (200 and 80 lines)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO, cli_env

PACKAGE = REPO / "mlxpipe"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Every module ``path`` imports (absolute names), lazy ones included; with ``runtime_only``, not those
    under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # from . import x: x may be a module
                names |= {f"{module}.{alias.name}" for alias in node.names}
            else:
                names.add(module)
    return names


def module_level_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports at module level (run on import, not lazily)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def table() -> dict[str, set[str]]:
    """ARCHITECTURE.md's rooms: each module path → the names its row allows."""
    rows: dict[str, set[str]] = {}
    for line in (REPO / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        allowed = set(re.findall(r"`([\w.]+)`", cells[2]))
        for path in re.findall(r"`([\w/]+\.(?:py|c|cpp))`", cells[0]):
            rows[path] = allowed
    return rows


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_and_source_file_has_a_row() -> None:
    rows = table()
    files = {str(p.relative_to(PACKAGE)) for p in modules()} | {
        str(p.relative_to(PACKAGE)) for suffix in ("*.c", "*.cpp") for p in PACKAGE.rglob(suffix)
    }
    assert files - rows.keys() == set(), "modules missing from ARCHITECTURE.md's table"
    assert rows.keys() - files == set(), "ARCHITECTURE.md names modules that do not exist"


def test_each_module_imports_only_what_its_row_allows() -> None:
    rows = table()
    wrong = []
    for path in modules():
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        allowed = rows[str(path.relative_to(PACKAGE))]
        for imported in imports(path):
            top = imported.split(".")[0]
            if top in STDLIB:
                continue
            if top != "mlxpipe":
                if top not in allowed:
                    wrong.append(f"{name} imports {imported}")
                continue
            if imported == package or (imported.startswith(package + ".") and package != "mlxpipe"):
                continue  # its own package
            inside = imported.removeprefix("mlxpipe.").removeprefix("mlxpipe")
            room = inside.split(".")[0] or "mlxpipe"
            if not ({room, inside} & allowed or any(inside.startswith(a + ".") for a in allowed)):
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def test_no_two_modules_import_each_other_at_run_time() -> None:
    names = {module_name(p): p for p in modules()}
    graph = {
        name: {i for i in imports(path, runtime_only=True) if i in names and not name.startswith(i + ".")}
        for name, path in names.items()
    }  # a module importing its own package's __init__ runs it first: not a cycle

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert [name for name in graph if name in reach(name)] == []


def test_only_the_engine_imports_mlx_lm_and_mlx_comes_after_the_blas() -> None:
    users = {module_name(p): {m.split(".")[0] for m in imports(p)} for p in modules()}
    lm = {name for name, tops in users.items() if "mlx_lm" in tops}
    assert all(name.startswith("mlxpipe.engine.") for name in lm), sorted(lm)
    # mlx at module level only where the package set up the BLAS: engine/ and cpu/ (others: cpu.mlx_core()).
    top_level = {module_name(p) for p in modules() if "mlx" in module_level_imports(p)}
    assert all(name.startswith(("mlxpipe.engine.", "mlxpipe.cpu.")) for name in top_level), sorted(top_level)
    assert "mlxpipe.cpu" in imports(PACKAGE / "engine" / "__init__.py")


def test_the_command_line_starts_without_importing_mlx() -> None:
    # --help, --version and usage errors must be instant: mlx is imported only once a model is needed.
    code = (
        "import sys, mlxpipe.cli, mlxpipe.cli.docs, mlxpipe.cli.term, mlxpipe.models\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_no_class_reaches_200_lines_nor_a_function_80() -> None:
    """A room stays readable in one sitting: every class under 200 lines, every function under 80."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                limit = 200
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = 80
            else:
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines >= limit:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long
