"""Fetching (parent process): PyPI's release index, and the kept files of each release.

A release's sdist is streamed once (never written to disk) and verified against PyPI's sha256;
a release with wheels only is range-read from its wheel and verified against the wheel's
``RECORD``. Only ``kv_events.py`` and the modules its event classes need (:func:`.extract.plan`)
are kept, in the cache, one directory per release with its ``source.json``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .extract import KV_EVENTS, Reader, plan

PYPI_JSON = "https://pypi.org/pypi/vllm/json"
USER_AGENT = "kvbridge-release-fixtures (+https://pypi.org/project/vllm/)"


def cache_dir(option: str | None) -> Path:
    """``--cache``, else ``$KVBRIDGE_CACHE/vllm-sdists``, else ``~/.cache/kvbridge/vllm-sdists``."""
    if option:
        return Path(option).expanduser()
    root = os.environ.get("KVBRIDGE_CACHE") or Path.home() / ".cache" / "kvbridge"
    return Path(root).expanduser() / "vllm-sdists"


def pypi_index(cache: Path, offline: bool) -> dict[str, Any]:
    """vLLM's release index from PyPI (kept in ``cache``), or the kept one when ``offline``."""
    index_file = cache / "pypi-index.json"
    if offline:
        kept: dict[str, Any] = json.loads(index_file.read_text())
        return kept
    with _open(PYPI_JSON) as response:
        full = json.load(response)
    index = {"releases": full["releases"]}
    index_file.write_text(json.dumps(index, sort_keys=True))
    return index


def version_key(version: str) -> tuple[int, ...]:
    """``"0.10.1"`` as ``(0, 10, 1)``, for sorting releases."""
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
    lo, hi = version_key(first), version_key(through)
    return sorted(
        (
            version
            for version, files in index["releases"].items()
            if re.fullmatch(r"\d+(\.\d+)*", version)
            and lo <= version_key(version) <= hi
            and any(not f.get("yanked") for f in files)
        ),
        key=version_key,
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


def _keep(read: Reader) -> dict[str, str]:
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
