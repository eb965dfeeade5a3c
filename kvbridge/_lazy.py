"""Public names imported on first use, for the package faces that must stay light to import."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence


def lazy_names(namespace: dict[str, object], names_of: Mapping[str, Sequence[str]]) -> None:
    """Make the names of ``names_of`` (``{module: names}``) the public names of the package
    whose globals are ``namespace``: its ``__all__``, and a module ``__getattr__`` and
    ``__dir__`` by which a name is imported from its module when first read, then kept in
    ``namespace`` so that it is looked up once.

    The ``__getattr__`` is set here, out of type checkers' sight: with a visible module
    ``__getattr__`` they would accept any attribute of the package, misspelt ones included.
    The package imports its names for them under ``TYPE_CHECKING``, as ``name as name``.
    """
    package = namespace["__name__"]
    module_of = {name: module for module, names in names_of.items() for name in names}

    def import_name(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted({*namespace, *module_of})

    namespace["__all__"] = sorted(module_of)
    namespace["__getattr__"] = import_name
    namespace["__dir__"] = names
