"""The server under many clients, run by hand: `python3 -m od_moe.bench.serving agreement|soak|alone`.

`agreement`: greedy requests sent together to a server at `--max-batch` are served in one running batch;
each answer is compared with the same prompt generated alone (`Engine.stream_generate`, stock mlx-lm's
arithmetic) and with the server's logged schedule replayed through mlx-lm's `BatchGenerator` on the stock
model. Batched kernels (other shapes, other reduction orders) may round differently from one sequence
alone, so "same as alone" is measured, and "same as the replay" must hold. `decode_per_pass`: the ledger's
decode lookups per sequence and per pass (`stats.per_pass`), served together and then each prompt alone.
`soak`: `--clients` threads each send `--requests` requests in turn: greedy and seeded-sampled, streamed
and not, with stop strings, some hung up mid-stream, some malformed (which must get a 4xx JSON error).
It reports what was lost or failed, throughput, and whether every greedy answer equals its replay.
`alone`: one request at a time, to a server at `--max-batch` 1 (the one-at-a-time path) and one at
`--max-batch` N (the batch path with a batch of one), alternating, `--rounds` each: the latency a lone
client sees on each path.
`ttft`: time to first token through the server, `--prompts` streamed greedy requests alone and arriving
together, beside stock mlx-lm's floor (`first_token.py`); a table, then the JSON.
All run the servers in this process on loopback ports (`clients.py`).
Not here: `od-moe bench --batch` (`batch_speed.py`: one batch at a time, no server).
"""

import argparse
import json
import logging
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from ..engine import DEFAULT_MODEL
from ..server.schedule import ScheduleLog, replay
from .batch_speed import batch_prompts
from .client_process import all_at_once
from .clients import hang_up, post, post_stream, start_server
from .first_token import ttft, ttft_table
from .foundation import stock_model
from .widen import DEFAULT_WORKDIR, widen_model


def replayed_tokens(log: ScheduleLog, stop_tokens) -> dict[int, list[int]]:
    """The logged schedule replayed through mlx-lm's BatchGenerator on the stock embedded model."""
    return replay(stock_model(DEFAULT_MODEL)[0], log, stop_tokens)


def agreement(prompts: int, max_tokens: int, capacity, max_batch: int) -> dict:
    """Greedy answers served together vs alone vs the replayed schedule, per prompt."""
    texts = batch_prompts(prompts)
    base, log, server, app = start_server(capacity, max_batch)
    engine = app.worker.engine
    replies: list[tuple[int, dict] | None] = [None] * len(texts)  # None where a client's thread raised

    def client(i):
        replies[i] = post(base, {"prompt": texts[i], "max_tokens": max_tokens, "temperature": 0})

    wall = all_at_once(client, len(texts))
    server.shutdown()
    app.worker.shutdown()
    served = {tuple(j.prompt): log.tokens[j.uid] for j in log.joins}
    reference = replayed_tokens(log, engine.tokenizer.eos_token_ids)
    per_pass = {"served": engine.stats()["per_pass"]["decode"]}
    engine.runtime.ledger.reset()  # from here: each prompt alone
    rows, same_alone, same_replay = [], 0, 0
    for text, answer in zip(texts, replies):
        assert answer is not None  # every client's thread posted its request and got an answer
        status, reply = answer
        ids = engine.encode(text)
        batched = served[tuple(ids)]
        alone = [r.token for r in engine.stream_generate(ids, max_tokens=max_tokens)]
        uid = next(j.uid for j in log.joins if j.prompt == ids)
        first = next((k for k, (a, b) in enumerate(zip(batched, alone)) if a != b), None)
        same_alone += batched == alone
        same_replay += batched == reference[uid]
        counted = status == 200 and reply["usage"]["completion_tokens"] == len(batched)
        rows.append({"answered": counted, "same_as_alone": batched == alone, "first_difference": first})
    return {
        "prompts": len(texts),
        "max_tokens": max_tokens,
        "capacity": engine.capacity,
        "max_batch": max_batch,
        "same_as_alone": same_alone,
        "same_as_replay": same_replay,
        "largest_batch": _largest_batch(app.worker),
        "wall_s": wall,
        "decode_per_pass": dict(per_pass, alone=engine.stats()["per_pass"]["decode"]),
        "rows": rows,
    }


def soak(clients: int, requests: int, capacity, max_batch: int, seed: int = 0) -> dict:
    """`clients` x `requests` mixed requests; what came back, and greedy answers against the replay."""
    base, log, server, app = start_server(capacity, max_batch)
    engine = app.worker.engine
    texts = batch_prompts(32)
    outcomes, lock = [], threading.Lock()

    def client(c):
        rng = random.Random(seed * 1000 + c)
        for r in range(requests):
            kind = rng.choices(["greedy", "sampled", "stop", "hang-up", "bad"], [6, 2, 1, 1, 1])[0]
            body = {"prompt": rng.choice(texts), "max_tokens": rng.randint(4, 24), "temperature": 0}
            body["stream"] = rng.random() < 0.5
            outcome = _one(base, kind, body, rng)
            with lock:
                outcomes.append(dict(outcome, kind=kind, client=c, request=r))

    wall = all_at_once(client, clients)
    deadline = time.time() + 60
    while app.worker.active and time.time() < deadline:
        time.sleep(0.1)
    server.shutdown()
    counters = dict(app.worker.counters)
    app.worker.shutdown()
    reference = replayed_tokens(log, engine.tokenizer.eos_token_ids)
    greedy = [j for j in log.joins if j.temperature == 0]
    unequal = [j.uid for j in greedy if log.tokens[j.uid] != reference[j.uid]]
    expected = {"greedy": 200, "sampled": 200, "stop": 200, "hang-up": None, "bad": 400}
    wrong = [o for o in outcomes if expected[o["kind"]] is not None and o["status"] != expected[o["kind"]]]
    tokens = sum(o.get("tokens", 0) for o in outcomes)
    return {
        "clients": clients,
        "requests": clients * requests,
        "answered": len(outcomes),
        "by_kind": {k: sum(o["kind"] == k for o in outcomes) for k in expected},
        "wrong_status": wrong[:10],
        "wrong_status_count": len(wrong),
        "server_counters": counters,
        "completion_tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "greedy_sequences": len(greedy),
        "greedy_unequal_to_replay": len(unequal),
        "largest_batch": _largest_batch(app.worker),
        "median_latency_s": statistics.median(o["latency_s"] for o in outcomes),
    }


def alone(rounds: int, max_tokens: int, capacity, max_batch: int) -> dict:
    """Seconds per lone request on the one-at-a-time path and on the batch path, rounds alternating."""
    servers = {1: start_server(capacity, 1), max_batch: start_server(capacity, max_batch)}
    seconds: dict[int, list[float]] = {n: [] for n in servers}
    texts = batch_prompts(rounds)
    for text in texts:
        answers = set()
        for n, (base, _, _, _) in servers.items():
            started = time.perf_counter()
            status, reply = post(base, {"prompt": text, "max_tokens": max_tokens, "temperature": 0})
            seconds[n].append(time.perf_counter() - started)
            answers.add(reply["choices"][0]["text"] if status == 200 else None)
        if len(answers) != 1:
            raise RuntimeError(f"the two paths answered {text!r} differently: {answers}")
    for _, _, server, app in servers.values():
        server.shutdown()
        app.worker.shutdown()
    return {
        "max_tokens": max_tokens,
        "rounds": rounds,
        "seconds": {str(n): [round(s, 3) for s in v] for n, v in seconds.items()},
        "median_s": {str(n): statistics.median(v) for n, v in seconds.items()},
    }


def _largest_batch(worker) -> int:
    """The most sequences one decode step ran (1 one at a time)."""
    return max((int(k) for k in worker.batch.passes), default=0) if worker.batch is not None else 1


def _one(base: str, kind: str, body: dict, rng: random.Random) -> dict:
    """Send one request of `kind`; its status, completion tokens and latency."""
    started = time.perf_counter()
    if kind == "bad":
        body = rng.choice(
            [{"prompt": ""}, {"prompt": "x", "max_tokens": -3}, {"prompt": 7}, {"max_tokens": 4}]
        )
    elif kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2**31))
    elif kind == "stop":
        body["stop"] = ["\n", "("]
    if kind == "hang-up":
        hang_up(base, dict(body, stream=True, max_tokens=200))
        return {"status": None, "latency_s": time.perf_counter() - started}
    status, reply = post_stream(base, body) if body.get("stream") else post(base, body)
    tokens = reply.get("usage", {}).get("completion_tokens", 0) if status == 200 else 0
    return {"status": status, "tokens": tokens, "latency_s": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m od_moe.bench.serving", description=__doc__.split("\n")[0]
    )
    parser.add_argument("what", choices=["agreement", "soak", "alone", "ttft"])
    parser.add_argument("--capacity", default=None, help="experts per layer (default: all that fit)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompts", type=int, help="agreement, ttft: concurrent greedy requests (16, 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=6, help="alone: requests on each path; ttft: rounds")
    parser.add_argument("--clients", type=int, default=16, help="soak: client threads")
    parser.add_argument("--requests", type=int, default=20, help="soak: requests per client")
    parser.add_argument("--model", help="ttft: serve this model folder instead of the embedded one")
    parser.add_argument(
        "--widen",
        type=int,
        help="ttft: serve the embedded model's copy with experts this many "
        "times wider (written under --workdir once)",
    )
    parser.add_argument(
        "--workdir", default=str(DEFAULT_WORKDIR), help="ttft: where the widened copy is kept"
    )
    parser.add_argument(
        "--switch-interval",
        help="ttft: the interpreter's switch intervals to compare, seconds (e.g. 0.005,0.0005)",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="ttft: run the clients on threads of the server's process (as before)",
    )
    args = parser.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    if args.what == "ttft":
        capacities = (None, "25%") if args.capacity is None else (args.capacity,)
        if args.model and args.widen:
            parser.error("--model and --widen: give one (--widen widens the embedded model)")
        model = args.model
        if args.widen:
            model = widen_model(DEFAULT_MODEL, Path(args.workdir) / f"widened-x{args.widen}", args.widen)
        report = ttft(
            args.prompts or 8,
            args.rounds,
            args.max_tokens,
            args.max_batch,
            capacities,
            model,
            args.same_process,
            [float(v) for v in args.switch_interval.split(",")] if args.switch_interval else [None],
        )
        print(ttft_table(report))
    elif args.what == "agreement":
        report = agreement(args.prompts or 16, args.max_tokens, args.capacity, args.max_batch)
    elif args.what == "alone":
        report = alone(args.rounds, args.max_tokens, args.capacity, args.max_batch)
    else:
        report = soak(args.clients, args.requests, args.capacity, args.max_batch)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
