"""The quick run (``pytest -m "not slow"``) still runs every test file: each keeps at least one test
that is not marked ``slow`` (tests/conftest.py says how the marks are kept right)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def marked_slow(node: ast.FunctionDef | ast.ClassDef) -> bool:
    return any(ast.unparse(decorator) == "pytest.mark.slow" for decorator in node.decorator_list)


def keeps_a_quick_test(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if "slow" in ast.unparse(node.value):
                return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and not marked_slow(node):
            return True
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test") and not marked_slow(node):
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef) and m.name.startswith("test")]
            if not methods or any(not marked_slow(method) for method in methods):  # none: inherited ones
                return True
    return False


def test_every_test_file_keeps_a_test_in_the_quick_run():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50
    assert [str(path.relative_to(TESTS)) for path in files if not keeps_a_quick_test(path)] == []
