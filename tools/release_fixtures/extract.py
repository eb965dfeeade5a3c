"""Which statements of a release's vLLM sources define its event classes, found with :mod:`ast`.

:func:`plan` starts at the event classes and ``MEDIUM_*`` constants of ``kv_events.py`` and
follows every module-level name they need, into other vLLM modules of the same release where
they are imported from there. It reads sources only and executes nothing: the parent uses it
to pick the files to keep, the worker to know what to execute.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import hashlib
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

KV_EVENTS = "vllm/distributed/kv_events.py"
EVENT_CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared")
"""Classes every release must define."""
OPTIONAL_CLASSES = ("KVEventBatch",)
CONSTANTS = re.compile(r"^MEDIUM_[A-Z0-9_]+$")
IMPORTABLE = frozenset(sys.stdlib_module_names) | {"msgspec"}
"""Top-level modules whose imports are executed as written (everything else is extracted from
the sdist when it is vLLM, and refused otherwise)."""

Reader = Callable[[str], str | None]
"""The text of a file of one release by its path in the sdist (``None``: no such file)."""


def directory_reader(files: Path) -> Reader:
    """A :data:`Reader` over the kept files of one release, as the cache holds them."""

    def read(path: str) -> str | None:
        file = files / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    return read


class ExtractError(Exception):
    """The event classes of a release cannot be extracted as they are."""


@dataclasses.dataclass
class ModulePlan:
    """What to execute of one module."""

    path: str
    names: set[str]
    body: list[ast.stmt]
    """The statements to execute, in source order (imports reduced to the names needed)."""
    injected: dict[str, tuple[str, str]]
    """Local name -> (module path, name) taken from another module of the same sdist."""

    def source(self) -> str:
        """The statements as source text."""
        return "\n".join(ast.unparse(stmt) for stmt in self.body) + "\n"


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return [stmt.name]
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    names: list[str] = []
    for target in targets:
        names.extend(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _loads(nodes: Iterable[ast.AST | None]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        if node is not None:
            names.update(
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            )
    return names


def _free_names(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement reads when it is executed (function bodies excluded)."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        a = stmt.args
        arguments = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
        return _loads(
            [
                *stmt.decorator_list,
                *a.defaults,
                *a.kw_defaults,
                stmt.returns,
                *(arg.annotation for arg in arguments if arg is not None),
            ]
        )
    if isinstance(stmt, ast.ClassDef):
        names = _loads([*stmt.decorator_list, *stmt.bases, *(k.value for k in stmt.keywords)])
        local: set[str] = set()
        for inner in stmt.body:
            names |= _free_names(inner) - local
            local.update(_bound_names(inner))
        return names
    return _loads([stmt])


def _module_path(module: str, level: int, importer: str) -> str:
    if level:
        package = importer.split("/")[:-level]
        module = ".".join([*package, *([module] if module else [])])
    return module.replace(".", "/")


def _plan_module(
    path: str, source: str, wanted: set[str], exists: Reader
) -> tuple[ModulePlan, dict[str, set[str]]]:
    """The statements of one module that define ``wanted``, and what they need elsewhere."""
    tree = ast.parse(source, filename=path)
    bindings: dict[str, list[int]] = {}
    for index, stmt in enumerate(tree.body):
        for name in _bound_names(stmt):
            bindings.setdefault(name, []).append(index)
    compound = {
        name
        for stmt in tree.body
        if isinstance(stmt, ast.If | ast.Try | ast.With | ast.For | ast.While)
        for inner in ast.walk(stmt)
        if isinstance(inner, ast.stmt) and inner is not stmt
        for name in _bound_names(inner)
    }
    keep: dict[int, ast.stmt] = {}
    imported: dict[int, set[str]] = {}
    injected: dict[str, tuple[str, str]] = {}
    foreign: dict[str, set[str]] = {}
    todo, seen = sorted(wanted), set()
    for index, stmt in enumerate(tree.body):  # `from __future__ import ...` changes semantics
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            keep[index] = stmt
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in bindings:
            if hasattr(builtins, name):
                continue
            where = " (only inside an if/try/with block)" if name in compound else ""
            raise ExtractError(f"{path}: {name!r} is not defined at module level{where}")
        for index in bindings[name]:
            stmt = tree.body[index]
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                aliases = [a for a in stmt.names if (a.asname or a.name).split(".")[0] == name]
                top = (
                    stmt.module.split(".")[0]
                    if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level
                    else aliases[0].name.split(".")[0]
                    if isinstance(stmt, ast.Import)
                    else "vllm"
                )
                if top in IMPORTABLE:
                    imported.setdefault(index, set()).add(name)
                elif top == "vllm" and isinstance(stmt, ast.ImportFrom):
                    module = _module_path(stmt.module or "", stmt.level, path)
                    target = exists(module + ".py") or exists(module + "/__init__.py")
                    if target is None:
                        raise ExtractError(f"{path}: needs {name!r} from missing {module}")
                    for alias in aliases:
                        injected[alias.asname or alias.name] = (target, alias.name)
                        foreign.setdefault(target, set()).add(alias.name)
                else:
                    raise ExtractError(
                        f"{path}: the event classes need {name!r} from {top!r}, which is not"
                        " installed here; stub it in tools/release_fixtures/extract.py and"
                        " document it"
                    )
            else:
                keep[index] = stmt
                todo.extend(sorted(_free_names(stmt) - seen))
    for index, names in imported.items():  # imports reduced to the names needed, in order
        stmt = tree.body[index]
        assert isinstance(stmt, ast.Import | ast.ImportFrom)
        aliases = [a for a in stmt.names if (a.asname or a.name).split(".")[0] in names]
        keep[index] = ast.copy_location(type(stmt)(**{**stmt.__dict__, "names": aliases}), stmt)
    body = [keep[index] for index in sorted(keep)]
    return ModulePlan(path, set(wanted), body, injected), foreign


def plan(read: Reader) -> list[ModulePlan]:
    """What to execute to define the event classes of one release, dependencies first."""
    source = read(KV_EVENTS)
    if source is None:
        raise ExtractError(f"no {KV_EVENTS}")
    tree = ast.parse(source)
    defined = {name for stmt in tree.body for name in _bound_names(stmt)}
    missing = [name for name in EVENT_CLASSES if name not in defined]
    if missing:
        raise ExtractError(f"{KV_EVENTS} defines no {', '.join(missing)}")
    roots = {*EVENT_CLASSES, *(n for n in OPTIONAL_CLASSES if n in defined)}
    roots |= {n for n in defined if CONSTANTS.match(n)}

    def exists(path: str) -> str | None:
        return path if read(path) is not None else None

    wanted: dict[str, set[str]] = {KV_EVENTS: roots}
    plans: dict[str, ModulePlan] = {}
    depends: dict[str, set[str]] = {}
    changed = True
    while changed:
        changed = False
        for path in sorted(wanted):
            if path in plans and plans[path].names == wanted[path]:
                continue
            text = read(path)
            assert text is not None
            plans[path], foreign = _plan_module(path, text, wanted[path], exists)
            depends[path] = set(foreign)
            for target, names in foreign.items():
                if not names <= wanted.setdefault(target, set()):
                    wanted[target] |= names
                    changed = True
    ordered: list[str] = []

    def visit(path: str, stack: tuple[str, ...]) -> None:
        if path in stack:
            raise ExtractError(f"import cycle: {' -> '.join((*stack, path))}")
        for dependency in sorted(depends[path]):
            visit(dependency, (*stack, path))
        if path not in ordered:
            ordered.append(path)

    visit(KV_EVENTS, ())
    return [plans[path] for path in ordered]


def definitions_sha256(plans: list[ModulePlan]) -> str:
    """Digest of the statements executed (normalised by ``ast.unparse``), all modules."""
    digest = hashlib.sha256()
    for module in plans:
        digest.update(f"# {module.path}\n{module.source()}".encode())
    return digest.hexdigest()
