"""The package's shape: control flows one way, the tiers meet in the store, modules are cut by what they own.

Read from the source (``ast``), not from what happens to be imported at run time.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tiered_ckpt"

# Lower first: a module imports only modules of its own layer or of a lower one.
# tensors/dtensor views and the CUDA copies import torch only when called and sit under the
# format; the DCP backend is glue over the manager; errors is the one tree everything raises from.
# testing (the contracts an out-of-tree tier or backend subclasses) sits on top: nothing imports it.
RANKS = {
    "errors": 0, "io": 1, "torch-views": 2, "format": 3, "dist": 4, "tiers": 4, "engine": 5, "top": 6, "dcp": 7,
    "testing": 8,
}  # fmt: skip
# A module may grow where it owns one thing (it says which in its docstring, and offers it in
# __all__); none grows past MAX_LINES, and the manager stays composition and docstrings.
MAX_LINES = 800
MAX_MANAGER_LINES = 410
# The one module that builds tiers from options; a tier's own folder builds it too (the peer's setup).
FACTORY = "tiered_ckpt.build"


def module_name(path: pathlib.Path) -> str:
    parts = ("tiered_ckpt", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    if module == "tiered_ckpt.errors":
        return "errors"
    if module in ("tiered_ckpt.torch.tensors", "tiered_ckpt.torch.dtensor", "tiered_ckpt.torch.device_copies"):
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


def test_the_factory_is_the_only_module_that_imports_more_than_one_tier():
    importers = [module for module, targets in GRAPH.items() if len(targets & tier_homes()) > 1]
    assert importers == ["tiered_ckpt.build"]


def test_the_store_imports_no_tier_but_its_first_the_local_disk():
    assert GRAPH["tiered_ckpt.tiers.store"] & tier_homes() == {"tiered_ckpt.tiers.local"}


def test_backend_modules_are_imported_only_by_the_object_store_tier_and_each_other():
    importers = {
        module
        for module, targets in GRAPH.items()
        if any(target.startswith("tiered_ckpt.tiers.remote.backends") for target in targets)
        and not module.startswith("tiered_ckpt.tiers.remote.backends")
    }
    assert importers <= {
        "tiered_ckpt.tiers.remote.tier",
        "tiered_ckpt.tiers.remote.checksums",
        "tiered_ckpt.testing.backend",
    }


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_its_line_limit(module):
    limit = MAX_MANAGER_LINES if module == "tiered_ckpt.manager" else MAX_LINES
    assert len(MODULES[module].read_text().splitlines()) <= limit


def test_the_package_and_its_testing_subpackage_import_without_pytest():
    code = "import sys, tiered_ckpt, tiered_ckpt.testing; assert 'pytest' not in sys.modules, 'pytest imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr == ""
    assert "tiered_ckpt.testing" not in {target for targets in GRAPH.values() for target in targets}


def defines_something(tree: ast.Module) -> bool:
    return any(not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)) for node in tree.body)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_owns_and_offers_it_in_all(module):
    tree = ast.parse(MODULES[module].read_text())
    if module.endswith("__main__") or (MODULES[module].name == "__init__.py" and not defines_something(tree)):
        return  # the entry point, and a folder's empty __init__, own nothing
    assert ast.get_docstring(tree), f"{module} says in a docstring what it owns"
    assigned = [target for node in tree.body if isinstance(node, ast.Assign) for target in node.targets]
    assigned += [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    offered = {target.id for target in assigned if isinstance(target, ast.Name)}
    assert "__all__" in offered, f"{module} lists what it offers in __all__"


def concrete_tiers() -> dict[str, str]:
    """Each concrete tier class under tiers/ (``module.Class``), with its home: its own folder, or its module."""
    found = {}
    for module, path in MODULES.items():
        if not module.startswith("tiered_ckpt.tiers."):
            continue
        parent = module.rpartition(".")[0]
        home = module if parent == "tiered_ckpt.tiers" or path.name == "__init__.py" else parent
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Tier"):
                if not any(getattr(base, "id", None) == "Protocol" for base in node.bases):
                    found[f"{module}.{node.name}"] = home
    return found


def constructed_tiers(module: str, tiers: dict[str, str]) -> set[str]:
    """The concrete tier classes ``module`` calls (imported by name, or as an attribute of an imported module)."""
    tree = ast.parse(MODULES[module].read_text())
    classes, modules = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target in tiers:
                    classes[alias.asname or alias.name] = target
                elif target in MODULES:
                    modules[alias.asname or alias.name] = target
    called = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in classes:
            called.add(classes[node.func.id])
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            target = f"{modules.get(node.func.value.id)}.{node.func.attr}"
            if target in tiers:
                called.add(target)
    return called


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def test_only_the_factory_and_a_tiers_own_folder_construct_a_concrete_tier():
    """Tests and the shipped contract (tiered_ckpt.testing) build tiers as they need."""
    tiers = concrete_tiers()
    assert {"tiered_ckpt.tiers.local.LocalTier", "tiered_ckpt.tiers.remote.tier.RemoteTier"} <= set(tiers)
    builders = {
        (module, tier)
        for module in MODULES
        for tier in constructed_tiers(module, tiers)
        if module != FACTORY and not within(module, tiers[tier]) and not within(module, "tiered_ckpt.testing")
    }
    assert builders == set()


def test_the_options_are_plain_data_that_import_no_stage():
    assert {target for target in GRAPH["tiered_ckpt.options"] if within(target, "tiered_ckpt.engine")} == set()


def tier_homes() -> set[str]:
    """The modules that define a concrete tier (the peer's and every other tier's included)."""
    return {name.rpartition(".")[0] for name in concrete_tiers()}


def test_no_engine_module_imports_a_concrete_tier():
    tiers = concrete_tiers()
    importing = {
        (module, target)
        for module, targets in GRAPH.items()
        if within(module, "tiered_ckpt.engine")
        for target in targets
        if target in tier_homes() or target in tiers
    }
    assert importing == set()


def identity_tests(source: str, label: str) -> list[str]:
    """The ``is``/``is not`` comparisons and ``isinstance`` checks in ``source`` that ask which tier
    something is: an operand naming a store's tier by role (``store.remote``, ``self.local``...)
    or a concrete tier class."""
    names = {name.rpartition(".")[2] for name in concrete_tiers()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Attribute) and o.attr in ("local", "remote", "peer") for o in operands):
                found.append(f"{label}:{node.lineno}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(getattr(kind, "id", None) in names for kind in kinds):
                found.append(f"{label}:{node.lineno}")
    return found


def test_no_engine_module_tests_a_tiers_identity():
    engine = [module for module in MODULES if within(module, "tiered_ckpt.engine")]
    assert [found for module in engine for found in identity_tests(MODULES[module].read_text(), module)] == []


def test_the_identity_check_sees_the_peer_tier_and_every_way_of_asking():
    assert {"tiered_ckpt.tiers.peer.tier", "tiered_ckpt.tiers.local", "tiered_ckpt.tiers.remote.tier"} <= tier_homes()
    asking = "if tier is store.remote or t is not self.peer or isinstance(t, (int, PeerTier)):\n    pass\n"
    assert identity_tests(asking, "probe") == ["probe:1", "probe:1", "probe:1"]
    assert identity_tests("if tier.capabilities.shared and t is not None:\n    pass\n", "probe") == []


HEAVY = ("numpy", "ml_dtypes", "fsspec", "yaml", "tiered_ckpt.manager", "tiered_ckpt.cli")


@pytest.mark.parametrize(
    "code",
    [
        "import tiered_ckpt",
        "from tiered_ckpt import CheckpointError, UsageError",
        "from tiered_ckpt.entry import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "from tiered_ckpt.entry import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass",
    ],
    ids=["package", "errors", "help", "version"],
)
def test_the_package_the_errors_and_the_commands_help_import_nothing_heavy(code):
    check = f"{code}\nimport sys\nprint(sorted(name for name in {HEAVY!r} if name in sys.modules))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_name_of_the_package_is_imported_when_first_used_and_a_bf16_array_brings_ml_dtypes():
    code = (
        "import sys, tiered_ckpt\n"
        "assert tiered_ckpt.CheckpointManager.__name__ == 'CheckpointManager'\n"
        "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes imported by the manager alone'\n"
        "assert tiered_ckpt.tiers.store.TieredStore is tiered_ckpt.TieredStore\n"
        "from tiered_ckpt.format.shardfile import DTYPES\n"
        "print(DTYPES['BF16'].name, 'ml_dtypes' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["bfloat16", "True"]
