"""The resident expert cache: which expert sits in which slot of a layer (`layer_cache.py`), the slot arrays
the bytes are written into (`slot_arrays.py`), saving and restoring that resident set (`snapshot.py`), and
replaying recorded routing through a cache under an eviction rule (`replay.py`).

Not here: reading bytes (`storage/`), or deciding what to prefetch (`prefetch/`).
"""
