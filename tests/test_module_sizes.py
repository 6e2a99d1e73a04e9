"""The house's size rules, checked on every Python file the repository tracks: no module over
600 lines, and no function over 80 lines except the ones listed below, which may only shrink.

The list is a debt to pay down: a new long function fails, a listed one that grows fails, and
one that is split (or shrinks to 80 or fewer lines) must leave the list, so it never hides a
new one. Lengths are counted by ``ast`` from ``def`` to the function's last line, nested
functions included in their parent's length.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# (path, qualified name) -> its length today; shrink this list, never grow it. Empty since
# session 17: any function over 80 lines fails.
LONG_FUNCTIONS: dict[tuple[str, str], int] = {}


def python_files() -> list[str]:
    """Every tracked .py file, and every untracked one git does not ignore (new work)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted({path for path in out.split() if (ROOT / path).is_file()})


def function_lengths(path: str) -> dict[str, int]:
    """Qualified name (``Class.method``, ``outer.inner``) -> lines, for each function."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=path)
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                assert child.end_lineno is not None
                lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return lengths


def test_the_file_list_covers_the_repository() -> None:
    files = python_files()
    assert "tests/test_module_sizes.py" in files and "engine/scheduler.py" in files
    assert not any(path.startswith(".venv/") for path in files)


def test_no_module_is_over_600_lines() -> None:
    too_long = {}
    for path in python_files():
        with open(ROOT / path, encoding="utf-8") as f:
            num_lines = sum(1 for _ in f)
        if num_lines > MAX_MODULE_LINES:
            too_long[path] = num_lines
    assert too_long == {}, f"split these by topic (at most {MAX_MODULE_LINES} lines each)"


def test_no_function_over_80_lines_beyond_the_shrinking_list() -> None:
    found = {}
    for path in python_files():
        for name, num_lines in function_lengths(path).items():
            if num_lines > MAX_FUNCTION_LINES:
                found[(path, name)] = num_lines
    new = {key: n for key, n in found.items() if key not in LONG_FUNCTIONS}
    grown = {key: n for key, n in found.items() if n > LONG_FUNCTIONS.get(key, n)}
    paid = sorted(key for key in LONG_FUNCTIONS if key not in found)
    assert new == {}, f"new functions over {MAX_FUNCTION_LINES} lines: split them"
    assert grown == {}, "listed long functions grew: split them instead"
    assert paid == [], "these are split or short now: take them off LONG_FUNCTIONS"
