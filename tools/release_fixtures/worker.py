"""The worker: executes one release's extracted event classes and encodes the samples with them.

It runs in a throwaway process per release (``python -m tools.release_fixtures --worker RELEASE
FILES``), so that the definitions of one release never meet those of another, and prints its
result as JSON for the parent. It must import neither kvbridge nor vLLM, and checks it.
"""

from __future__ import annotations

import ast
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from .extract import (
    CONSTANTS,
    EVENT_CLASSES,
    KV_EVENTS,
    OPTIONAL_CLASSES,
    ExtractError,
    ModulePlan,
    definitions_sha256,
    directory_reader,
    plan,
)
from .samples import DATA_PARALLEL_RANK, OPTIONAL_VALUES, SAMPLES, TS, Sample, to_json


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

    plans = plan(directory_reader(files))
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
    """Encode the samples with the classes of one release; the classes' description, the
    samples encoded and skipped, and the payload (hex), for the manifest."""
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
