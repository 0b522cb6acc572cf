"""`od-moe serve`: an OpenAI-compatible HTTP server over one engine (installed as `od_moe.server`).

`requests.py` validates request bodies, `worker.py` runs generations one at a time on one thread with
prompt-cache reuse, `app.py` is the Flask app (`create_app`) and `serve` starts it.
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
