"""Storage: a model's files, where each expert's bytes are on disk (`store.py`), what they look like in
memory (`layout.py`), and the packed copy `od-moe pack` writes (`packed.py`).

Not here: which experts are resident (`caching/`), or the runtimes that read through the store.
"""
