"""A package's exports loaded on first use (PEP 562): `from detlib.data import FORMATS` imports the module that
defines it, not the package's every module, so a script's --help (which needs a few names) does not wait for torch.
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """(`__getattr__`, `__all__`) of `package` whose names are `exports` ({submodule: names}); a name is imported
    from its submodule when first asked for and kept in the package."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module_of[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(module_of)


def no_grad(fn):
    """`fn` under `torch.no_grad()`, torch imported when it is called (importing a script for its --help needs none)."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapped
