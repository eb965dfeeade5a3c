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

The package imports only the standard library and msgspec, never kvbridge: the fixtures check
kvbridge, so they must not be derived from it.

Usage::

    python -m tools.release_fixtures                     # 0.9.0 .. 0.33.0
    python -m tools.release_fixtures --through 0.34.0    # add the next release
    python -m tools.release_fixtures --offline           # rebuild from the cache only

(from the repository root). The modules: :mod:`.samples` (the fixed sample events),
:mod:`.extract` (picking the definitions with :mod:`ast`), :mod:`.fetch` (PyPI and the cache),
:mod:`.worker` (executing and encoding, in a throwaway process) and :mod:`.__main__` (the
command line: scan, run the workers, write the fixtures and the manifest).

The cache is ``--cache``, else ``$KVBRIDGE_CACHE/vllm-sdists``, else
``~/.cache/kvbridge/vllm-sdists``; one directory per release holding ``source.json`` (where the
files came from) and the kept files under their paths in the sdist.

A release without an sdist on PyPI (0.15.0 and 0.15.1 have wheels only) is read from its wheel
with HTTP range requests (a few hundred KB of a 500 MB file): the members are verified against
the wheel's own ``RECORD``, but the wheel's sha256 is not (that would need the whole wheel), and
``source.json`` and the manifest say so. ``--no-wheels`` skips such releases instead.
"""
