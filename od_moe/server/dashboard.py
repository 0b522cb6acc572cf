"""The live dashboard: a page at `/` and `/dashboard`, and the document it polls, `/dashboard/data`.

The page (`static/dashboard.html`, `.css`, `.js`, shipped in the package; no CDN, no web fonts) asks for the
document twice a second and draws it. The document is read from the engine's live ledger as /health reads
it (`engine.stats(settle=False)`: no MLX work on a request thread, figures move token by token) and from
the worker's request counters; `History` keeps samples of the last minutes, so the plots of hit rate and
tok/s are there as soon as the page opens, and every viewer sees the same curves. The per-layer strip says,
per expert, whether it is resident and how it got there (pinned, prefetched and not used yet, prefetched,
read on demand); `batch` is the running batch (its size, the queue, each request's tok/s); `drafts` the draft
model's acceptance, where one is loaded; `tiers` where lanes found their experts (device slots, host memory,
disk) and what the disk did.
Not here: /health and /metrics (`health.py`), the API routes (`app.py`).
"""

import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
from flask import Flask, jsonify, send_from_directory

from .health import batch_figures

STATIC = Path(__file__).parent / "static"
# No inline code, nothing from elsewhere: the page can only talk to this server.
CSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'"
# One character per expert of a layer, in `strip` order of precedence (the last that applies wins).
ABSENT, DEMAND, PREFETCHED, UNUSED_PREFETCH, PINNED = ".", "d", "f", "u", "p"
CODES = np.array([ABSENT, DEMAND, PREFETCHED, UNUSED_PREFETCH, PINNED])
# the worker's request figures the page does not show (/health has them)
PROMPT_FIGURES = ("prompt_tokens", "cached_prompt_tokens")


class History:
    """Samples (time, generated tokens, decode lookups, decode hits, decoding seconds) of the last
    `keep_s` seconds, at most one every `every_s`, taken when the document is asked for (nobody watching:
    nothing to keep). The times, tokens and seconds are the worker's `DecodeClock`'s, for tok/s."""

    def __init__(self, keep_s: float = 300.0, every_s: float = 0.25):
        self.keep_s, self.every_s = keep_s, every_s
        self.samples: deque = deque()
        self.lock = threading.Lock()

    def add(self, t: float, tokens: int, lookups: int, hits: int, decode_s: float) -> list[tuple]:
        """Record a sample (unless the last is newer than `every_s`) and return the samples kept."""
        with self.lock:
            if not self.samples or t - self.samples[-1][0] >= self.every_s:
                self.samples.append((t, tokens, lookups, hits, decode_s))
            while self.samples and t - self.samples[0][0] > self.keep_s:
                self.samples.popleft()
            return list(self.samples)


def rates(samples: list[tuple], window_s: float = 2.0, min_decode_s: float = 0.5) -> dict:
    """Decode tok/s and hit rate over the last `window_s` seconds (or since the first sample, if it is
    newer), and the plot points [seconds ago, hit rate, tok/s] over one-second steps. tok/s is the tokens
    decoded in a span over the time spent decoding in it, so idle time (and prefill) before a request do
    not dilute its first seconds: 0 for a span without decoding, None for one with under `min_decode_s`
    of it (too little to mean anything yet). None too: under half a second of samples; a hit rate
    without lookups."""
    points, last = [], None
    for s in samples:
        if last is None or s[0] - last[0] >= 1.0:
            if last is not None:
                points.append(_rate_between(last, s, min_decode_s))
            last = s
    now = samples[-1]
    start = next((s for s in reversed(samples) if now[0] - s[0] >= window_s), samples[0])
    if now[0] - start[0] < 0.5:  # too short a span to mean anything yet
        recent = (now[0], None, None)
    else:
        recent = _rate_between(start, now, min_decode_s)
    return {
        "tok_s": recent[2],
        "hit_rate": recent[1],
        "points": [[round(t - now[0], 2), h, tps] for t, h, tps in points],
    }


def _rate_between(a: tuple, b: tuple, min_decode_s: float) -> tuple:
    lookups, busy = b[2] - a[2], b[4] - a[4]
    hit_rate = (b[3] - a[3]) / lookups if lookups else None
    if busy <= 0:
        return b[0], hit_rate, 0.0
    return b[0], hit_rate, (b[1] - a[1]) / busy if busy >= min_decode_s else None


def strip(cache) -> str:
    """One character per expert of a layer (`CODES`): what sits in the cache now and how it got there.
    Read without locks while the generation thread may be installing: a display may lag one install."""
    held = cache.expert_in_slot.copy()
    kind = np.where(cache.arrived_by_prefetch, 2, 1)
    kind = np.where(cache.unused_prefetch, 3, kind)
    kind = np.where(cache.pinned, 4, kind)
    out = np.zeros(cache.num_experts, dtype=np.int64)
    out[held[held >= 0]] = kind[held >= 0]
    return "".join(CODES[out])


def tier_card(tiers: dict, passes: int) -> dict:
    """The tiers as the page shows them: experts a layer in each, each tier's share of the routed lanes (all
    passes), and what the disk did (bytes read, the wait a decode pass, passes run again because one met an
    expert on disk), and which host row goes first past the host's memory."""
    lanes, disk = tiers["lanes"], tiers["disk"]
    total = sum(lanes.values())
    return {
        "experts_per_layer": tiers["experts_per_layer"],
        "lane_shares": {tier: n / total if total else None for tier, n in lanes.items()},
        "disk_bytes_read": disk["bytes_read"],
        "disk_wait_ms_per_pass": disk["wait_s"] * 1e3 / passes if passes else None,
        "reruns": disk["reruns"],
        "host_eviction": tiers["host_eviction"],
    }


def dashboard_data(worker, name: str, started: float, history: History) -> dict:
    """The document the page draws: decode figures since the server started (the ones /health gives),
    rates over the last seconds, plot points, requests and the per-layer strip."""
    engine = worker.engine
    stats = engine.stats(settle=False)
    decode, io = stats["total"]["decode"], stats["io"]["decode"]
    passes, tokens = int(stats["passes"]["decode"]), int(stats["generated_tokens"])
    prefetch = stats["prefetch"]
    requests = {k: v for k, v in worker.request_figures().items() if k not in PROMPT_FIGURES}
    requests["in_flight"] = requests["active"] + requests["queued"]
    now, clock = time.time(), worker.decode_clock
    # samples on the decode clock's own time: a window's span and the decoding seconds in it on one clock
    at = clock.now()
    decoded, decode_s = clock.read()
    recent = rates(history.add(at, decoded, decode["lookups"], decode["hits"], decode_s))
    return {
        "time": now,
        "uptime_s": now - started,
        "status": worker.state(),
        "model": name,
        "decode": {  # passes run one ahead of the tokens given out (accounting/ledger.py); reads are per pass
            "passes": passes,
            "generated_tokens": tokens,
            "lookups": decode["lookups"],
            "hits": decode["hits"],
            "hit_rate": decode["hit_rate"],
            "bytes_read": io["bytes_read"],
            "stall_s": io["stall_s"],
            "bytes_per_pass": io["bytes_read"] / passes if passes else None,
            "stall_ms_per_pass": io["stall_s"] * 1e3 / passes if passes else None,
            "experts_per_token": stats[
                "experts_per_token"
            ],  # read (in place) plus copied: accounting/ledger.py
            "experts_moved_as": stats["moved_as"],
        },
        "drafts": worker.drafting.figures(stats),
        "prefetch": {
            k: prefetch.get(k) for k in ("policy", "precision", "issued", "useful", "wasted", "late", "mode")
        },
        "recent": {"tok_s": recent["tok_s"], "hit_rate": recent["hit_rate"]},
        "memory": {k: stats["memory"].get(k) for k in ("device_bytes", "host_bytes")},
        "history": recent["points"],
        "requests": requests,
        "batch": batch_figures(worker),
        "tiers": tier_card(stats["tiers"], passes),
        "ranks": worker.rank_rows(),  # across ranks: one row each
        "cache": {
            "capacity": stats["capacity"],
            "num_experts": stats["num_experts"],
            "miss_policy": stats["miss_policy"],
            "layers": [strip(c) for c in engine.caches],
        },
    }


def register(app: Flask, worker, name: str, started: float):
    """Add the page (`/`, `/dashboard`), its files (`/dashboard/static/...`) and its document to `app`."""
    history = History()

    def page():
        return send_from_directory(STATIC, "dashboard.html"), {"Content-Security-Policy": CSP}

    app.add_url_rule("/", "dashboard_home", page)
    app.add_url_rule("/dashboard", "dashboard", page)

    @app.get("/dashboard/static/<path:filename>")
    def dashboard_static(filename):
        return send_from_directory(STATIC, filename)

    @app.get("/dashboard/data")
    def dashboard_document():
        return jsonify(dashboard_data(worker, name, started, history)), {"Cache-Control": "no-store"}
