"""The benchmark of tiered_ckpt, outside the package: ``python -m benchmarks`` from the repository root.

:mod:`benchmarks.harness` holds what the sections share; each other module is one section,
importing the harness and the library, never another section; ``__main__`` picks them.
"""

__all__: list[str] = []
