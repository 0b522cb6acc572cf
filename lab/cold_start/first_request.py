"""Lab: a server started cold, with and without `serve`'s warm-up (not product code).

Each run is a fresh process: load (the bundled model unless MODEL is given), start the server as `serve`
does (`warm_up.py` on or off), then one streamed greedy request; one JSON line: seconds from the
process's start to ready, and from sending the request to its first text and to its end.

  python3 lab/cold_start/first_request.py on|off|single [--two-tier on|off] [--max-batch N] [--model M]

`on` warms up as `serve` does; `single` as `serve` did before it warmed its batch path (one sequence).
"""

import argparse
import json
import threading
import time
import urllib.request

START = time.perf_counter()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("warm_up", choices=["on", "off", "single"])
    parser.add_argument("--two-tier", default="auto")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--model")
    parser.add_argument("--capacity", default="25%")
    args = parser.parse_args()

    from werkzeug.serving import make_server

    import od_moe
    from od_moe.server import create_app
    from od_moe.server.warm_up import warm_up
    from od_moe.server.worker import GenerationWorker

    two_tier = {"on": True, "off": False}.get(args.two_tier, args.two_tier)

    warmed = []

    def loader():
        engine = od_moe.load(args.model, capacity=args.capacity, two_tier=two_tier, sequences=args.max_batch)
        if args.warm_up != "off":
            warmed.append(warm_up(engine, max_batch=args.max_batch if args.warm_up == "on" else 1))
        return engine

    worker = GenerationWorker(loader=loader, max_batch=args.max_batch)
    app = create_app(worker=worker)
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ready = time.perf_counter() - START
    body = {"prompt": "def fibonacci(n):\n", "max_tokens": 16, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.server_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    sent, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and b'"text"' in line:
                first = time.perf_counter() - sent
    end = time.perf_counter() - sent
    srv.shutdown()
    worker.stop()
    out = dict(warm_up=args.warm_up, two_tier=args.two_tier, max_batch=args.max_batch, ready_s=ready)
    out.update(
        warmed_up_s=warmed[0] if warmed else None,
        first_text_s=first,
        request_s=end,
        mode=worker.engine.mode[0],
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
