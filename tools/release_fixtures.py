#!/usr/bin/env python3
"""Encode KV-event fixtures with the event classes of every vLLM release that changed them.

For each final vLLM release in a range (default 0.9.0 through 0.33.0) this tool

1. downloads the release's sdist from PyPI once, streaming it (the tarball is never written to
   disk), verifies its sha256 against the digest PyPI publishes, and keeps only
   ``vllm/distributed/kv_events.py`` plus the vLLM modules that define names the event classes
   need (``ExternalBlockHash`` lives in ``vllm/v1/core/kv_cache_utils.py``), in a cache outside
   the repository;
2. keeps the releases whose ``kv_events.py`` differs (sha256) from that of the previous release;
3. for each kept release, in a throwaway subprocess (``--worker``), extracts with :mod:`ast` the
   event classes (``EventBatch``, ``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``,
   ``AllBlocksCleared``, ``KVEventBatch``), the ``MEDIUM_*`` constants and every module-level
   name they need, executes exactly those statements with the real ``msgspec`` and ``typing``,
   and encodes a fixed set of sample events with them, as vLLM's publisher does
   (``msgspec.msgpack.Encoder().encode(batch)``);
4. writes ``vllm-<release>.msgpack`` per kept release and ``manifest.json`` (provenance, the
   declared fields of every class, the sample values, the skipped samples) to
   ``tests/fixtures/releases/``.

Nothing is stubbed. A name imported from another vLLM module is extracted from that module of
the same sdist (recursively); stdlib and msgspec imports are executed as written; anything else
(zmq, torch, vLLM's logger or config) is never executed because the event classes do not need
it. If a future release makes them need it, the worker stops and names it.

The tool imports only the standard library and msgspec, never kvbridge: the fixtures check
kvbridge, so they must not be derived from it.

Usage::

    python tools/release_fixtures.py                     # 0.9.0 .. 0.33.0
    python tools/release_fixtures.py --through 0.34.0    # add the next release
    python tools/release_fixtures.py --offline           # rebuild from the cache only

The cache is ``--cache``, else ``$KVBRIDGE_CACHE/vllm-sdists``, else
``~/.cache/kvbridge/vllm-sdists``; one directory per release holding ``source.json`` (where the
files came from) and the kept files under their paths in the sdist.

A release without an sdist on PyPI (0.15.0 and 0.15.1 have wheels only) is read from its wheel
with HTTP range requests (a few hundred KB of a 500 MB file): the members are verified against
the wheel's own ``RECORD``, but the wheel's sha256 is not (that would need the whole wheel), and
``source.json`` and the manifest say so. ``--no-wheels`` skips such releases instead.
"""

from __future__ import annotations

import argparse
import ast
import base64
import builtins
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types
import typing
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "releases"
PYPI_JSON = "https://pypi.org/pypi/vllm/json"
USER_AGENT = "kvbridge-release-fixtures (+https://pypi.org/project/vllm/)"
KV_EVENTS = "vllm/distributed/kv_events.py"

EVENT_CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared")
"""Classes every release must define."""
OPTIONAL_CLASSES = ("KVEventBatch",)
CONSTANTS = re.compile(r"^MEDIUM_[A-Z0-9_]+$")
IMPORTABLE = frozenset(sys.stdlib_module_names) | {"msgspec"}
"""Top-level modules whose imports are executed as written (everything else is extracted from
the sdist when it is vLLM, and refused otherwise)."""

# ---------------------------------------------------------------------------------------------
# The fixed sample set
# ---------------------------------------------------------------------------------------------

SHA_A = hashlib.sha256(b"a").digest()
SHA_B = hashlib.sha256(b"b").digest()
SHA_PARENT = hashlib.sha256(b"parent").digest()
U64_A = int.from_bytes(SHA_A[-8:], "big")  # 13366815110101616827
U64_B = int.from_bytes(SHA_B[-8:], "big")  # 14660323646696587421

TS = 1700000000.5
DATA_PARALLEL_RANK = 3

OPTIONAL_VALUES: dict[str, Any] = {
    "lora_id": 7,
    "medium": "GPU",
    "lora_name": "adapter-a",
    "extra_keys": [["adapter-a", "salt-1"], None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": 128,
    "locality": "LOCAL",
    "ownership": "kvcr",
    "session_id": "sess-1",
    "lookahead_token_ids": [[9, 10]],
}
"""The value of every field beyond the first four of ``BlockStored`` (and beyond
``block_hashes`` of ``BlockRemoved``), used by the samples with ``fill=True``."""


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    event: str
    values: dict[str, Any]
    """Values of these fields where the release's class has them."""
    fill: bool
    """Also set every other field of the class that :data:`OPTIONAL_VALUES` has a value for;
    otherwise fields with a default stay at it."""


SAMPLES: tuple[Sample, ...] = (
    Sample(
        "stored_int",
        "BlockStored",
        {
            "block_hashes": [U64_A, U64_B],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "block_size": 4,
        },
        fill=True,
    ),
    Sample(
        "stored_negative",
        "BlockStored",
        {
            "block_hashes": [-42, -(2**63)],
            "parent_block_hash": -1234567890123456789,
            "token_ids": [9, 10, 11, 12, 13, 14, 15, 16],
            "block_size": 4,
        },
        fill=True,
    ),
    Sample(
        "stored_bytes",
        "BlockStored",
        {
            "block_hashes": [SHA_A, SHA_B],
            "parent_block_hash": SHA_PARENT,
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "block_size": 4,
        },
        fill=True,
    ),
    Sample(
        "stored_defaults",
        "BlockStored",
        {
            "block_hashes": [U64_B],
            "parent_block_hash": U64_A,
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "lora_id": None,
            "medium": None,
            "lora_name": None,
        },
        fill=False,
    ),
    Sample("removed", "BlockRemoved", {"block_hashes": [U64_A]}, fill=True),
    Sample("cleared", "AllBlocksCleared", {}, fill=False),
)


def to_json(value: Any) -> Any:
    """JSON form of a sample value: bytes become ``{"bytes": "<hex>"}``, tuples lists."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list | tuple):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def samples_json() -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "event": s.event,
            "values": to_json(s.values),
            "fill": s.fill,
        }
        for s in SAMPLES
    ]


# ---------------------------------------------------------------------------------------------
# Extracting the definitions (pure ast; used by the parent to pick the files to keep and by the
# worker to execute them)
# ---------------------------------------------------------------------------------------------


class ExtractError(Exception):
    pass


@dataclasses.dataclass
class ModulePlan:
    path: str
    names: set[str]
    body: list[ast.stmt]
    """The statements to execute, in source order (imports reduced to the names needed)."""
    injected: dict[str, tuple[str, str]]
    """Local name -> (module path, name) taken from another module of the same sdist."""

    def source(self) -> str:
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
    names = []
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
    path: str, source: str, wanted: set[str], exists: Callable[[str], str | None]
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
                        " installed here; stub it in tools/release_fixtures.py and document it"
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


def plan(read: Callable[[str], str | None]) -> list[ModulePlan]:
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


# ---------------------------------------------------------------------------------------------
# The worker: runs in a throwaway process, one per release
# ---------------------------------------------------------------------------------------------


def _type_str(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_str(arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if tp is Ellipsis:
        return "..."
    if origin is not None:
        args = ", ".join(_type_str(arg) for arg in typing.get_args(tp))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]"
    if isinstance(tp, type):
        return tp.__qualname__
    return repr(tp)


def _class_info(cls: type[msgspec.Struct], annotations: dict[str, str]) -> dict[str, Any]:
    config = cls.__struct_config__
    hints = typing.get_type_hints(cls)
    fields = []
    for field in msgspec.structs.fields(cls):
        entry: dict[str, Any] = {"name": field.name, "type": _type_str(hints[field.name])}
        if annotations.get(field.name) != entry["type"]:  # as written in the source
            entry["annotation"] = annotations.get(field.name)
        entry["required"] = field.required
        if not field.required:
            default = (
                field.default if field.default is not msgspec.NODEFAULT else field.default_factory
            )
            entry["default"] = to_json(default) if default is None else repr(default)
        fields.append(entry)
    return {
        "bases": [base.__name__ for base in cls.__bases__],
        "array_like": config.array_like,
        "omit_defaults": config.omit_defaults,
        "forbid_unknown_fields": config.forbid_unknown_fields,
        "tag_field": config.tag_field,
        "tag": config.tag,
        "fields": fields,
    }


def _annotations(plans: list[ModulePlan], name: str) -> dict[str, str]:
    """Source text of each annotated field of class ``name`` and its bases, base first."""
    classes = {
        stmt.name: stmt
        for module in plans
        if module.path == KV_EVENTS
        for stmt in module.body
        if isinstance(stmt, ast.ClassDef)
    }
    out: dict[str, str] = {}
    node = classes.get(name)
    if node is None:
        return out
    for base in node.bases:
        if isinstance(base, ast.Name):
            out.update(_annotations(plans, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out[stmt.target.id] = ast.unparse(stmt.annotation)
    return out


def load(release: str, files: Path) -> tuple[list[ModulePlan], dict[str, Any]]:
    """Execute the extracted definitions of one release; the kv_events namespace."""

    def read(path: str) -> str | None:
        file = files / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    plans = plan(read)
    package = "_vllm_" + re.sub(r"\W", "_", release)
    loaded: dict[str, types.ModuleType] = {}
    for module_plan in plans:
        name = f"{package}.{module_plan.path.removesuffix('.py').replace('/', '.')}"
        module = types.ModuleType(name)
        module.__file__ = str(files / module_plan.path)
        sys.modules[name] = module  # msgspec resolves string annotations through sys.modules
        for local, (path, original) in module_plan.injected.items():
            module.__dict__[local] = getattr(loaded[path], original)
        code = compile(
            ast.Module(body=module_plan.body, type_ignores=[]),
            f"vllm-{release}/{module_plan.path}",
            "exec",
        )
        exec(code, module.__dict__)
        loaded[module_plan.path] = module
    return plans, loaded[KV_EVENTS].__dict__


def _sample_kwargs(sample: Sample, cls: type[msgspec.Struct]) -> tuple[dict[str, Any], list[str]]:
    kwargs: dict[str, Any] = {}
    unsampled: list[str] = []
    for field in msgspec.structs.fields(cls):
        if field.name in sample.values:
            kwargs[field.name] = sample.values[field.name]
        elif sample.fill and field.name in OPTIONAL_VALUES:
            kwargs[field.name] = OPTIONAL_VALUES[field.name]
        elif field.required:
            raise ExtractError(f"no sample value for the required field {field.name!r}")
        elif sample.fill:
            unsampled.append(field.name)
    return kwargs, unsampled


def worker(release: str, files: Path) -> dict[str, Any]:
    plans, namespace = load(release, files)
    classes = {
        name: namespace[name] for name in (*EVENT_CLASSES, *OPTIONAL_CLASSES) if name in namespace
    }
    for name, cls in classes.items():
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            raise ExtractError(f"{name} is not a msgspec.Struct")
    encoder = msgspec.msgpack.Encoder()
    events: list[Any] = []
    described: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    unsampled: dict[str, list[str]] = {}
    for sample in SAMPLES:
        cls = classes[sample.event]
        try:
            kwargs, missing = _sample_kwargs(sample, cls)
        except ExtractError as error:
            skipped.append({"sample": sample.name, "reason": str(error)})
            continue
        if missing:
            unsampled[sample.name] = missing
        try:  # msgspec checks types on decode only: round-trip through the release's class
            event = msgspec.msgpack.decode(encoder.encode(cls(**kwargs)), type=cls)
        except msgspec.ValidationError as error:
            skipped.append({"sample": sample.name, "reason": f"{sample.event} refuses it: {error}"})
            continue
        events.append(event)
        described.append(
            {
                "sample": sample.name,
                "type": sample.event,
                "values": {
                    f.name: to_json(getattr(event, f.name)) for f in msgspec.structs.fields(cls)
                },
            }
        )
    batch_name = "KVEventBatch" if "KVEventBatch" in classes else "EventBatch"
    batch_cls = classes[batch_name]
    batch_values = {"ts": TS, "events": events, "data_parallel_rank": DATA_PARALLEL_RANK}
    batch_kwargs = {}
    for field in msgspec.structs.fields(batch_cls):
        if field.name in batch_values:
            batch_kwargs[field.name] = batch_values[field.name]
        elif field.required:
            raise ExtractError(f"{batch_name} has an unknown required field {field.name!r}")
    batch = batch_cls(**batch_kwargs)
    payload = encoder.encode(batch)
    if msgspec.msgpack.decode(payload, type=batch_cls) != batch:
        raise ExtractError(f"{batch_name} does not round-trip its own payload")
    if "kvbridge" in sys.modules or "vllm" in sys.modules:
        raise ExtractError("the worker must import neither kvbridge nor vllm")
    return {
        "msgspec": msgspec.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "executed": {
            module.path: [ast.unparse(stmt).splitlines()[0] for stmt in module.body]
            for module in plans
        },
        "injected": {
            f"{module.path}:{local}": f"{path}:{name}"
            for module in plans
            for local, (path, name) in sorted(module.injected.items())
        },
        "definitions_sha256": definitions_sha256(plans),
        "classes": {
            name: _class_info(cls, _annotations(plans, name)) for name, cls in classes.items()
        },
        "constants": {name: namespace[name] for name in sorted(namespace) if CONSTANTS.match(name)},
        "batch_class": batch_name,
        "batch": {
            "ts": TS,
            "data_parallel_rank": batch_kwargs.get("data_parallel_rank"),
        },
        "events": described,
        "skipped": skipped,
        "unsampled_fields": unsampled,
        "payload_hex": payload.hex(),
    }


# ---------------------------------------------------------------------------------------------
# Fetching (parent process)
# ---------------------------------------------------------------------------------------------


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _open(url: str, headers: Mapping[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
    for attempt in range(4):
        try:
            return urllib.request.urlopen(request, timeout=120)
        except OSError:
            if attempt == 3:
                raise
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def list_releases(index: Mapping[str, Any], first: str, through: str) -> list[str]:
    """Final releases (``N.N[.N...]``) in ``[first, through]`` with a non-yanked file."""
    lo, hi = _version_key(first), _version_key(through)
    return sorted(
        (
            version
            for version, files in index["releases"].items()
            if re.fullmatch(r"\d+(\.\d+)*", version)
            and lo <= _version_key(version) <= hi
            and any(not f.get("yanked") for f in files)
        ),
        key=_version_key,
    )


class _HashingReader(io.RawIOBase):
    """Hashes and counts every byte read through it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.raw.readinto(buffer)
        if n:
            self.sha256.update(memoryview(buffer)[:n])
            self.size += n
        return n or 0


class _RangeReader(io.RawIOBase):
    """A seekable read-only file over HTTP range requests."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos, self.fetched = url, size, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.size or not len(buffer):
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        with _open(self.url, {"Range": f"bytes={self.pos}-{end}"}) as response:
            if response.status != 206:
                raise OSError(f"{self.url}: no range support (HTTP {response.status})")
            data = response.read()
        memoryview(buffer)[: len(data)] = data
        self.pos += len(data)
        self.fetched += len(data)
        return len(data)


def _keep(read: Callable[[str], str | None]) -> dict[str, str]:
    """The files of one release the worker needs: kv_events.py and its dependencies."""
    kept = {KV_EVENTS: read(KV_EVENTS)}
    kept.update({module.path: read(module.path) for module in plan(read)})
    return {path: text for path, text in sorted(kept.items()) if text is not None}


def _from_sdist(url: str, entry: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    sources: dict[str, str] = {}
    with _open(url) as response:
        reader = _HashingReader(response)
        with tarfile.open(fileobj=io.BufferedReader(reader, 1 << 20), mode="r|gz") as tar:
            for member in tar:
                _, _, path = member.name.partition("/")
                if member.isfile() and path.startswith("vllm/") and path.endswith(".py"):
                    handle = tar.extractfile(member)
                    assert handle is not None
                    sources[path] = handle.read().decode("utf-8")
        while reader.read(1 << 20):  # the bytes after the last member, for the digest
            pass
    digest = reader.sha256.hexdigest()
    if digest != entry["digests"]["sha256"] or reader.size != entry["size"]:
        raise OSError(f"{entry['filename']}: sha256 {digest} / {reader.size} bytes do not match")
    return _keep(sources.get), {
        "kind": "sdist",
        "filename": entry["filename"],
        "size": entry["size"],
        "sha256": digest,
        "verified": "sha256 of the whole sdist equals the digest PyPI publishes",
        "downloaded": reader.size,
    }


def _from_wheel(url: str, entry: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    raw = _RangeReader(url, entry["size"])
    with zipfile.ZipFile(io.BufferedReader(raw, 1 << 18)) as wheel:
        names = set(wheel.namelist())
        record_name = next(n for n in sorted(names) if n.endswith(".dist-info/RECORD"))
        record = {
            line.split(",")[0]: line.split(",")[1]
            for line in wheel.read(record_name).decode().splitlines()
            if line.count(",") >= 2
        }
        cache: dict[str, str | None] = {}

        def read(path: str) -> str | None:
            if path not in cache:
                if path not in names:
                    cache[path] = None
                else:
                    data = wheel.read(path)
                    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                    if record.get(path) != "sha256=" + digest.rstrip(b"=").decode():
                        raise OSError(f"{entry['filename']}: {path} does not match RECORD")
                    cache[path] = data.decode("utf-8")
            return cache[path]

        kept = _keep(read)
    return kept, {
        "kind": "wheel",
        "filename": entry["filename"],
        "size": entry["size"],
        "sha256": entry["digests"]["sha256"],
        "verified": (
            "each kept file matches the wheel's RECORD; the wheel's own sha256 (PyPI) was NOT"
            " checked: this release has no sdist, and the wheel was range-read"
        ),
        "downloaded": raw.fetched,
    }


def fetch(
    release: str, files: list[Mapping[str, Any]], cache: Path, wheels: bool
) -> dict[str, Any] | None:
    """Cache the kept files of one release; its ``source.json`` (``None``: nothing to read)."""
    directory = cache / release
    source_file = directory / "source.json"
    if source_file.is_file():
        source: dict[str, Any] = json.loads(source_file.read_text())
        if all(
            hashlib.sha256((directory / path).read_bytes()).hexdigest() == digest
            for path, digest in source["files"].items()
        ):
            return {**source, "downloaded": 0}
    usable = [f for f in files if not f.get("yanked")]
    sdists = sorted((f for f in usable if f["packagetype"] == "sdist"), key=lambda f: f["filename"])
    wheel_files = sorted(
        (f for f in usable if f["packagetype"] == "bdist_wheel"), key=lambda f: f["filename"]
    )
    if sdists:
        entry, reader = sdists[0], _from_sdist
    elif wheels and wheel_files:
        entry, reader = wheel_files[0], _from_wheel
    else:
        return None
    kept, source = reader(urllib.parse.urljoin(PYPI_JSON, entry["url"]), entry)
    source["release"] = release
    source["url"] = urllib.parse.urljoin(PYPI_JSON, entry["url"])
    source["files"] = {
        path: hashlib.sha256(text.encode()).hexdigest() for path, text in kept.items()
    }
    if directory.exists():
        shutil.rmtree(directory)
    staging = Path(tempfile.mkdtemp(prefix=f".{release}-", dir=cache))
    try:
        for path, text in kept.items():
            (staging / path).parent.mkdir(parents=True, exist_ok=True)
            (staging / path).write_bytes(text.encode())
        (staging / "source.json").write_text(
            json.dumps({k: v for k, v in source.items() if k != "downloaded"}, indent=2) + "\n"
        )
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return source


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def _cache_dir(option: str | None) -> Path:
    if option:
        return Path(option).expanduser()
    root = os.environ.get("KVBRIDGE_CACHE") or Path.home() / ".cache" / "kvbridge"
    return Path(root).expanduser() / "vllm-sdists"


def dumps(value: Any, indent: int = 0, prefix: int = 0) -> str:
    """JSON with each value on one line when it fits in 100 columns (compact, diff-friendly)."""
    flat = json.dumps(value)
    if indent + prefix + len(flat) <= 99 or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{pad}{json.dumps(k)}: {dumps(v, indent + 2, len(json.dumps(k)) + 2)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 2) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _run_worker(release: str, files: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-I", str(Path(__file__).resolve()), "--worker", release, str(files)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        raise SystemExit(f"worker for vLLM {release} failed:\n{result.stderr}")
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="first", default="0.9.0")
    parser.add_argument("--through", default="0.33.0")
    parser.add_argument("--cache", help="default: $KVBRIDGE_CACHE/vllm-sdists")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=4, help="parallel downloads")
    parser.add_argument("--offline", action="store_true", help="use the cached index only")
    parser.add_argument("--no-wheels", dest="wheels", action="store_false")
    parser.add_argument("--worker", nargs=2, metavar=("RELEASE", "FILES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        json.dump(worker(args.worker[0], Path(args.worker[1])), sys.stdout)
        return 0

    started = time.monotonic()
    cache = _cache_dir(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    index_file = cache / "pypi-index.json"
    if args.offline:
        index = json.loads(index_file.read_text())
    else:
        with _open(PYPI_JSON) as response:
            full = json.load(response)
        index = {"releases": full["releases"]}
        index_file.write_text(json.dumps(index, sort_keys=True))
    releases = list_releases(index, args.first, args.through)
    print(f"{len(releases)} final releases {args.first} .. {args.through}", file=sys.stderr)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        sources = dict(
            zip(
                releases,
                pool.map(lambda r: fetch(r, index["releases"][r], cache, args.wheels), releases),
                strict=True,
            )
        )
    downloaded = sum(s["downloaded"] for s in sources.values() if s)

    scanned: list[dict[str, Any]] = []
    kept: list[str] = []
    previous_file = previous_defs = None
    for release in releases:
        source = sources[release]
        if source is None:
            scanned.append({"release": release, "source": None, "note": "no sdist or wheel"})
            continue
        files = cache / release

        def read(path: str, files: Path = files) -> str | None:
            file = files / path
            return file.read_text(encoding="utf-8") if file.is_file() else None

        file_digest = source["files"][KV_EVENTS]
        defs_digest = definitions_sha256(plan(read))
        changed = file_digest != previous_file
        entry = {
            "release": release,
            "source": source["kind"],
            "filename": source["filename"],
            "sha256": source["sha256"],
            "kv_events_sha256": file_digest,
            "definitions_sha256": defs_digest,
            "changed": changed,
        }
        if defs_digest != previous_defs and not changed:
            entry["note"] = "the definitions changed although kv_events.py did not"
            changed = True
        if changed:
            kept.append(release)
        scanned.append(entry)
        previous_file, previous_defs = file_digest, defs_digest

    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("vllm-*.msgpack"):
        if stale.stem.removeprefix("vllm-") not in kept:
            stale.unlink()
    entries = []
    versions: set[str] = set()
    msgspec_versions: set[str] = set()
    for position, release in enumerate(kept):
        source = sources[release]
        assert source is not None
        result = _run_worker(release, cache / release)
        payload = bytes.fromhex(result.pop("payload_hex"))
        fixture = f"vllm-{release}.msgpack"
        (args.out / fixture).write_bytes(payload)
        following = kept[position + 1] if position + 1 < len(kept) else None
        same = [
            e["release"]
            for e in scanned
            if e.get("source")
            and _version_key(release) <= _version_key(e["release"])
            and (following is None or _version_key(e["release"]) < _version_key(following))
        ]
        msgspec_versions.add(result.pop("msgspec"))
        versions.add(result.pop("python"))
        batch_info = result["classes"][result["batch_class"]]
        if not batch_info["array_like"]:
            print(f"WARNING: vLLM {release}: {result['batch_class']} is NOT array_like")
        entries.append(
            {
                "release": release,
                "fixture": fixture,
                "payload_sha256": hashlib.sha256(payload).hexdigest(),
                "payload_bytes": len(payload),
                "same_kv_events_through": same[-1],
                "source": {
                    k: source[k] for k in ("kind", "filename", "size", "sha256", "verified")
                },
                "kv_events_sha256": source["files"][KV_EVENTS],
                "files": source["files"],
                **result,
            }
        )
        print(
            f"{fixture:24} {len(payload):5} bytes  kv_events.py {source['files'][KV_EVENTS][:12]}"
            f"  same through {same[-1]}"
            + (
                f"  skipped: {[s['sample'] for s in result['skipped']]}"
                if result["skipped"]
                else ""
            )
        )
    manifest = {
        "generator": "tools/release_fixtures.py",
        "range": {"from": args.first, "through": args.through},
        "msgspec": sorted(msgspec_versions),
        "python": sorted(versions),
        "ts": TS,
        "data_parallel_rank": DATA_PARALLEL_RANK,
        "optional_values": OPTIONAL_VALUES,
        "samples": samples_json(),
        "scanned": scanned,
        "releases": entries,
    }
    (args.out / "manifest.json").write_text(dumps(manifest) + "\n")
    elapsed = time.monotonic() - started
    print(
        f"{len(kept)} of {len(releases)} releases changed kv_events.py; downloaded"
        f" {downloaded / 1e6:.1f} MB in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
