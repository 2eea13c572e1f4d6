"""Development code shared by `tests/` and `benchmarks/` (neither's own): the peers detlib is compared with.

Not part of the installed package; importable from the repository root (pytest puts the root on `sys.path`
through `pythonpath` in pyproject.toml, benchmarks/kit.py adds it for the benchmark scripts)."""
