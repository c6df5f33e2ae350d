"""The quick run's list of slow tests (tests/conftest.py) names tests that exist: a test renamed
or moved would otherwise leave the list silently and slow the quick run down."""

import re
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def test_every_slow_entry_names_a_test_function_of_its_file():
    missing = []
    for entry in conftest._SLOW:
        file, _, test = entry.partition("::")
        name = test.partition("[")[0].rpartition("::")[2]
        sources = [TESTS / file, TESTS / "tier_contract.py"] if "::" in test else [TESTS / file]
        if not any(path.exists() and re.search(rf"def {re.escape(name)}\b", path.read_text()) for path in sources):
            missing.append(entry)
    assert not missing, f"entries of conftest._SLOW naming no test: {missing}"
