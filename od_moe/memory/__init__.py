"""Memory planning: what the backend and the device have (`backend.py`, `cuda.py`), how many expert slots a
budget buys (`capacity.py`), and what a load would do before any weight is read (`preflight.py`).

Not here: where the bytes come from (`storage/`), or which path runs with those slots (`assembly.py`).
"""
