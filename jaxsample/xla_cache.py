"""JAX's persistent compilation cache, mended: entries are written whole, and an entry
JAX cannot read is rewritten.

Turned on by `jaxsample.disk_cache.enable_compilation_cache`; a wrapper of
JAX's private `jax._src.lru_cache.LRUCache` (jax 0.10), left out on a JAX
without it.
"""

from __future__ import annotations

import pathlib

from jaxsample.cache_files import atomic_write, in_the_way, log, warn_in_the_way


def rewrite_unreadable_entries() -> bool:
    """Make JAX's persistent cache write each entry whole and replace one it could not read.

    JAX writes a new entry in place (`pathlib.Path.write_bytes`), so a second
    process compiling the same program can read it half-written: an unreadable
    entry, a compile wasted. With eviction off (jaxsample's setting) a new entry
    goes to a temporary file renamed into place (`atomic_write`), so a reader sees
    the whole entry or none. With eviction on, JAX's own write stands (it holds
    its lock and keeps the access times), and so does it where the temporary
    file cannot be written (JAX then warns, as it would).

    JAX reads an entry before compiling and writes one after; a read that
    fails (a corrupt or truncated file) only warns, and the write then skips
    the key because its file exists (`jax._src.lru_cache.LRUCache.put`), so
    every later process compiles again. So `get` notes each key whose file
    this process read, and `put` of a noted key (read, yet compiled again: the
    file was unusable) replaces the file atomically, with one warning line. A
    key another process wrote meanwhile was never read here and is left to
    JAX. A directory at an entry's path is named (`in_the_way`) and read as
    no entry. Installed once per process; a JAX without this private class is
    left as it is (returns False).
    """
    try:
        from jax._src import lru_cache
        get, put = lru_cache.LRUCache.get, lru_cache.LRUCache.put
        suffix = lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        return False
    if getattr(put, "_jaxsample_rewrites", False):
        return True
    read: set[pathlib.Path] = set()  # the entries this process read

    def entry(cache, key) -> pathlib.Path:
        return pathlib.Path(str(cache.path)) / f"{key}{suffix}"

    def get_noting(self, key):
        path = entry(self, key)
        if in_the_way(path):
            warn_in_the_way("compilation cache entry", path)
            return None
        value = get(self, key)
        if value is not None:
            read.add(path)
        return value

    def put_rewriting(self, key, value):
        path = entry(self, key)
        if path not in read or not path.is_file():
            if self.eviction_enabled or not key or path.exists() or \
                    not atomic_write(path, value):
                return put(self, key, value)  # a write that fails is JAX's to warn of
            return None
        read.discard(path)
        if atomic_write(path, value):
            log.warning("jaxsample: warning: compilation cache entry %s was unusable; "
                        "rewritten", path.name)
        return None

    put_rewriting._jaxsample_rewrites = True
    lru_cache.LRUCache.get = get_noting
    lru_cache.LRUCache.put = put_rewriting
    return True
