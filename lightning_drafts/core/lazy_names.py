"""Public names of a package that load on first use (PEP 562), for the package facades.

A facade lists ``name -> defining module``; a name's module is imported when the name is first read, so
importing the facade costs nothing (``lightning-drafts --help`` answers without torch) and a facade may
name modules of layers above the package's own (``lightning_drafts.callbacks`` names the workflows'
``ServedAcceptanceCallback``) without importing them with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, public: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its module globals are its ``sys.modules`` entry's),
    loading each name of ``public`` from the module it maps to."""

    def __getattr__(name: str) -> Any:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(public[name]), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(public))

    return __getattr__, __dir__
