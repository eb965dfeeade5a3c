"""Public names imported on first use, for the package faces that must stay light to import."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(
    package: str, namespace: dict[str, object], module_of: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: a name of ``module_of`` is
    imported from its module when first read, and kept in ``namespace`` (the package's
    globals) so that it is looked up once."""

    def import_name(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted({*namespace, *module_of})

    return import_name, names
