"""Model identity for the kvstore namespace: a digest of the WHOLE content of the files.

Two checkpoints that differ in any byte (fine-tunes with frozen embeddings differ only deep
inside their files) must never share a namespace, or one model's KV would serve the other.
Hashing every byte of a large model takes a while (sha256, ~1 GB/s), so digests are cached in
``$TANDEM_HOME/fingerprints.json`` by (absolute path, size, mtime): a restart re-hashes only
files that changed. A hub snapshot is identified by its commit hash instead (the hub already
content-addresses it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from services.common.paths import tandem_home

log = logging.getLogger(__name__)
CACHE_FILE = "fingerprints.json"


def digest(*parts: bytes) -> str:
    """sha256 over length-prefixed parts (so part boundaries cannot be shifted)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def file_digest(path: Path, cache_path: Path | None = None) -> str:
    """sha256 of every byte of ``path``, from the cache when its size and mtime still match."""
    path = Path(path).resolve()
    st = path.stat()
    key = str(path)
    stamp = [st.st_size, st.st_mtime_ns]
    cache_path = cache_path or tandem_home() / CACHE_FILE
    cache = _read(cache_path)
    hit = cache.get(key)
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    started = time.perf_counter()
    with open(path, "rb") as f:
        value = hashlib.file_digest(f, "sha256").hexdigest()
    if st.st_size > 1 << 30:
        log.info("fingerprinted %s (%.1f GB) in %.1fs", path.name, st.st_size / 1e9, time.perf_counter() - started)
    cache = _read(cache_path)  # another process may have written meanwhile
    cache[key] = {"stamp": stamp, "sha256": value}
    _write(cache_path, cache)
    return value


def content_fingerprint(files: list[Path], *, cache_path: Path | None = None) -> str:
    """Identity of a set of files (a model folder's config, weights, tokenizer): their names and
    full-content digests."""
    parts = []
    for f in sorted(files, key=lambda p: p.name):
        parts += [f.name.encode(), file_digest(f, cache_path).encode()]
    return digest(b"content", *parts)


def hub_fingerprint(hub_id: str, commit: str) -> str:
    return digest(b"hub", hub_id.encode(), commit.encode())


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError as exc:  # a read-only home only costs re-hashing next time
        log.warning("cannot write the fingerprint cache %s: %s", path, exc)
