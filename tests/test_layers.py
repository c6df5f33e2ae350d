"""The package's shape: control flows one way, the tiers meet in the store, no module grows too big.

Read from the source (``ast``), not from what happens to be imported at run time.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tiered_ckpt"

# Lower first: a module imports only modules of its own layer or of a lower one.
# tensors/dtensor views never import torch and sit under the format; the DCP backend is glue
# over the manager; errors is the one tree everything raises from.
RANKS = {"errors": 0, "io": 1, "torch-views": 2, "format": 3, "dist": 4, "tiers": 4, "engine": 5, "top": 6, "dcp": 7}
TIERS = {"tiered_ckpt.tiers.local", "tiered_ckpt.tiers.remote.tier"}
MAX_LINES = 500
MAX_MANAGER_LINES = 400


def module_name(path: pathlib.Path) -> str:
    parts = ("tiered_ckpt", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    if module == "tiered_ckpt.errors":
        return "errors"
    if module in ("tiered_ckpt.torch.tensors", "tiered_ckpt.torch.dtensor"):
        return "torch-views"
    if module.startswith("tiered_ckpt.torch"):
        return "dcp"
    parts = module.split(".")
    subpackage = len(parts) == 2 and MODULES[module].name == "__init__.py"  # tiered_ckpt.tiers itself
    return parts[1] if len(parts) > 2 or subpackage else "top"


def imports(module: str) -> set[str]:
    """The package's modules ``module`` imports (the package itself, run by every import, left out)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tiered_ckpt"):
            for target in (node.module, *(f"{node.module}.{alias.name}" for alias in node.names)):
                if target in MODULES and target not in (module, "tiered_ckpt"):
                    found.add(target)
    return found


GRAPH = {module: imports(module) for module in MODULES}


def test_no_module_imports_a_higher_layer():
    upward = {
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if RANKS[layer(target)] > RANKS[layer(module)]
    }
    assert upward == set()


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            assert state.get(target) != 1, " -> ".join([*path[path.index(target) :], target])
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_the_store_and_the_factory_are_the_only_modules_that_import_more_than_one_tier():
    importers = [module for module, targets in GRAPH.items() if len(targets & TIERS) > 1]
    assert importers == ["tiered_ckpt.build", "tiered_ckpt.tiers.store"]


def test_backend_modules_are_imported_only_by_the_object_store_tier_and_each_other():
    importers = {
        module
        for module, targets in GRAPH.items()
        if any(target.startswith("tiered_ckpt.tiers.remote.backends") for target in targets)
        and not module.startswith("tiered_ckpt.tiers.remote.backends")
    }
    assert importers <= {"tiered_ckpt.tiers.remote.tier", "tiered_ckpt.tiers.remote.checksums"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_its_line_limit(module):
    limit = MAX_MANAGER_LINES if module == "tiered_ckpt.manager" else MAX_LINES
    assert len(MODULES[module].read_text().splitlines()) <= limit
