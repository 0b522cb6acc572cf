"""Memory planning: what the backend and the device have (`backend.py`, `cuda.py`), and how many expert slots
a budget buys (`capacity.py`).

Not here: where the bytes come from (`storage/`), which path runs with those slots (`assembly.py`), or what a
whole load would do before any weight is read (`od_moe/preflight.py`).
"""
