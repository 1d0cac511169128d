"""Lazy package exports: names are imported from their submodule on first use, so light tools
(``packrl config``) do not pay for torch or transformers imports."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``exports`` (name -> submodule of ``package``).

    The value is cached on the package, so a submodule of the same name (importing it sets a
    package attribute) cannot shadow the exported function.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
