"""`od-moe serve`: an OpenAI-compatible HTTP server over one engine (installed as `od_moe.server`).

`requests.py` validates request bodies, `guard.py` checks Host, Origin and the body itself before any route
reads it, `worker.py` runs generations on one thread with prompt-cache reuse and cancellation (and a draft
model where one is loaded), its tok/s timed by `decode_clock.py`, one at a
time or decoded together (`batching.py`, whose schedule `schedule.py` logs and replays through mlx-lm),
`health.py` writes /health and /metrics, `anthropic.py` speaks the Messages API, `app.py` is the Flask app
(`create_app`) and `serve` starts it, answering that the model is loading until it is ready (`starting.py`).
Not here: generation itself (the engine, `od_moe/engine.py`, and either path under it), the split over
ranks (`od_moe/distributed/`; serving across them is `ranks.py`), the benchmarks that load a server
(`od_moe/bench/serving.py`).
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
