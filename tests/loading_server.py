"""Run by `tests/test_server_start.py`: `od-moe serve` whose model never finishes loading. Its loader makes
small MLX evaluations until the process ends, as a load goes in and out of MLX; once the server serves, the
port is said on stderr (`serving port N`).

    loading_server.py OD-MOE-ARGUMENTS...
"""

import sys

import mlx.core as mx
from werkzeug import serving

from od_moe.cli import main
from od_moe.server import app


def never_loaded(*args):
    def loader():
        one = mx.array([1.0])
        while True:
            mx.eval(one + 1)

    return loader


make_server = serving.make_server


def announced(*args, **kwargs):
    server = make_server(*args, **kwargs)
    serve_forever = server.serve_forever

    def serving_forever(*a, **k):  # its signal handlers are in place by now
        print(f"serving port {server.port}", file=sys.stderr, flush=True)
        return serve_forever(*a, **k)

    server.serve_forever = serving_forever
    return server


app.warmed_loader = never_loaded
serving.make_server = announced
sys.exit(main(sys.argv[1:]))
