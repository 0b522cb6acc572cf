"""The server's `/health` document and `/metrics` (the same figures in the Prometheus text format).

Both read the engine's live ledger from any thread (`engine.stats(settle=False)`) and the worker's
counters; `status` is the worker's real state (`GenerationWorker.state`); `decode_per_pass` books decode
lookups per sequence and per pass (`stats.per_pass`: the batch's distinct experts, looked up once for all
its sequences, against its sequences' lookups); `batch` is the running batch (`batch_figures`: its size,
the queue, each request's and the total tok/s, the decode steps booked by batch size); `drafts` is the
draft model and what it drafted (`drafting.ServerDraft.figures`); across ranks, `ranks` has one row per rank
(`ranks.Leader.rows`: its layers, state, hit rate and reads), else null.
Not here: routes (`app.py`).
"""

import time

# name: (type, help) of every metric /metrics exports; the values come from `health_body`.
METRICS = {
    "expert_cache_hits_total": ("counter", "Expert lookups that found the expert resident."),
    "expert_cache_misses_total": ("counter", "Expert lookups that had to read the expert."),
    "expert_cache_hit_rate": ("gauge", "Fraction of expert lookups found resident (prefill and decode)."),
    "expert_cache_decode_hit_rate": ("gauge", "Fraction of decode-time expert lookups found resident."),
    "expert_cache_prefill_hit_rate": ("gauge", "Fraction of prefill-time expert lookups found resident."),
    "expert_bytes_read_total": ("counter", "Bytes of expert weights read from disk."),
    "expert_stall_seconds_total": ("counter", "Seconds the generation thread waited for expert reads."),
    "expert_cache_resident": ("gauge", "Experts resident now, all MoE layers together."),
    "model_decode_passes_total": (
        "counter",
        "Decode passes the model ran: one more per request than tokens generated (mlx-lm computes a token "
        "ahead, and that pass reads experts too).",
    ),
    "model_decode_positions_total": (
        "counter",
        "Sequences decoded, pass by pass: a decode pass of a batch of 8 counts 8.",
    ),
    "expert_cache_decode_pass_experts_total": (
        "counter",
        "Distinct experts routed by a decode pass of an MoE layer (a batch's union, looked up once for all "
        "its sequences), summed over the layer passes whose routing was read (on the host, or on the "
        "device for two-tier staged passes).",
    ),
    "expert_cache_decode_pass_hits_total": ("counter", "Of those, the experts resident when the layer ran."),
    "expert_cache_decode_routings_read_total": (
        "counter",
        "Decode layer passes whose routing was read (where the distinct experts are counted).",
    ),
    "expert_cache_decode_experts_per_layer_pass": (
        "gauge",
        "Distinct experts per MoE layer per decode pass (the batch's union), where the routing was read.",
    ),
    "expert_cache_capacity": ("gauge", "Expert slots per MoE layer."),
    "decode_experts_per_token": (
        "gauge",
        "Experts decode passes read (two-tier mode: read in place plus copied) per generated token.",
    ),
    "draft_verify_passes_total": ("counter", "Decode passes that verified a draft model's tokens."),
    "draft_tokens_total": ("counter", "Draft tokens verified."),
    "draft_accepted_tokens_total": ("counter", "Generated tokens that were a draft's, accepted."),
    "draft_acceptance_rate": ("gauge", "Fraction of the draft tokens verified that were accepted."),
    "expert_tier_experts": ("gauge", "Experts a layer each tier holds at most (device, host, disk)."),
    "expert_tier_lanes_total": (
        "counter",
        "Routed lanes by the tier their expert was in when the layer ran: device slots, host memory read in "
        "place, disk (read first).",
    ),
    "expert_disk_reads_total": ("counter", "Experts read from disk (on demand and ahead of need)."),
    "expert_disk_bytes_read_total": ("counter", "Bytes of experts read from disk."),
    "expert_disk_wait_seconds_total": ("counter", "Seconds passes waited for reads from disk."),
    "expert_disk_reruns_total": (
        "counter",
        "Decode passes run again because they met an expert on disk (three tiers).",
    ),
    "expert_disk_prefetch_reads_total": ("counter", "Reads from disk ahead of need (three tiers)."),
    "expert_disk_prefetch_wasted_total": ("counter", "Of those, evicted before any pass used them."),
    "prefetch_precision": ("gauge", "Fraction of prefetched experts used before eviction."),
    "prefetch_issued_total": ("counter", "Expert reads issued by prefetch."),
    "prefetch_late_total": ("counter", "Prefetched experts needed before their read finished."),
    "layer_hit_rate": ("gauge", "Fraction of expert lookups found resident, per MoE layer."),
    "requests_total": ("counter", "Generation requests accepted."),
    "requests_completed_total": ("counter", "Generation requests completed."),
    "requests_failed_total": ("counter", "Generation requests that failed while generating."),
    "requests_cancelled_total": ("counter", "Generation requests whose client went away."),
    "requests_rejected_total": ("counter", "Requests refused with a 4xx error."),
    "requests_active": ("gauge", "Requests generating now (prefilling or decoding)."),
    "requests_queued": ("gauge", "Requests waiting for the generation thread."),
    "requests_prompt_tokens_total": ("counter", "Prompt tokens of completed requests."),
    "requests_cached_prompt_tokens_total": ("counter", "Prompt tokens taken from the reused KV cache."),
    "requests_completion_tokens_total": ("counter", "Tokens generated (given to clients)."),
    "batch_size": ("gauge", "Requests in the running batch (prefilling or decoding)."),
    "batch_decoding": ("gauge", "Requests of the running batch decoding a token each pass."),
    "batch_max": ("gauge", "The most requests decoded together (--max-batch)."),
    "decode_tokens_per_second": (
        "gauge",
        "Tokens over the seconds spent decoding, all requests together, since the server started.",
    ),
    "request_tokens_per_second": ("gauge", "Decode tok/s of each request in the running batch."),
    "up": ("gauge", "1 while the generation thread can serve requests, else 0."),
    "rank_up": ("gauge", "Across ranks: 1 while a rank runs its layers, else 0."),
    "rank_decode_hit_rate": (
        "gauge",
        "Across ranks: the fraction of a rank's decode lookups found resident.",
    ),
    "rank_expert_bytes_read_total": ("counter", "Across ranks: bytes of expert weights a rank read."),
    "memory_peak_bytes": (
        "gauge",
        "Peak memory of the MLX backend, in bytes (its arrays, host memory a GPU reads in place included).",
    ),
    "memory_device_bytes": (
        "gauge",
        "Device memory as the driver counts it (CUDA): the card's use since the model loaded, this process's "
        "context included, in bytes; NaN where the device computes in host memory.",
    ),
    "memory_host_bytes": ("gauge", "Host memory resident for this process as the OS counts it, in bytes."),
    "uptime_seconds": ("gauge", "Seconds since the server started."),
}


def health_body(worker, name: str, started: float) -> dict:
    """The /health document, from the engine's live ledger: it moves token by token during a generation."""
    stats = worker.engine.stats(settle=False)
    total = stats["total"]
    prefetch = stats["prefetch"]
    requests = worker.request_figures()
    return {
        "status": worker.state(),
        "last_error": worker.last_error,
        "model_loaded": worker.engine is not None,
        "model": name,
        "expert_cache_stats": {
            "cache_hits": total.get("hits", 0),
            "cache_misses": total.get("misses", 0),
            "hit_rate": total.get("hit_rate"),
            "decode_hit_rate": total["decode"]["hit_rate"],
            "decode_lookups": total["decode"]["lookups"],
            "prefill_hit_rate": total.get("prefill", {}).get("hit_rate"),
            "working_set_experts": total.get("resident", 0),
            "pinned_experts": total.get("pinned", 0),
            "capacity": stats.get("capacity"),
            "capacity_fraction": stats.get("capacity_fraction"),
            "num_experts": stats.get("num_experts"),
            "moe_layers": stats.get("moe_layers"),
            "per_layer_hit_rate": [layer["hit_rate"] for layer in stats.get("layers", [])],
            "prefetch": prefetch,
            "bytes_read": total.get("bytes_read", 0),
            "stall_s": total.get("stall_s", 0.0),
            "experts_loaded": total.get("experts_loaded", 0),
            "evictions": total.get("evictions", 0),
            "miss_policy": stats.get("miss_policy"),
            # decode passes run one ahead of the tokens given out (accounting/ledger.py): never add one
            # to the other
            "prefill_positions": stats["positions"]["prefill"],
            "decode_passes": stats["passes"]["decode"],
            "decode_positions": stats["positions"]["decode"],
            "generated_tokens": stats["generated_tokens"],
            "decode_per_pass": stats["per_pass"]["decode"],
            "experts_per_token": stats[
                "experts_per_token"
            ],  # decode's, per generated token (accounting/ledger.py)
            "experts_moved_as": stats["moved_as"],
            "tiers": stats["tiers"],
        },
        "drafts": worker.drafting.figures(stats),
        "memory": stats.get("memory", {}),
        "uptime_s": time.time() - started,
        "requests": requests,
        "batch": batch_figures(worker),
        "ranks": worker.rank_rows(),
    }


def batch_figures(worker) -> dict:
    """The running batch: its size and limit, the queue, each request's figures (`batching.py`; none one
    at a time), total decode tok/s (all requests, decoding time only) and the steps by batch size."""
    if worker.batch is not None:
        figures = worker.batch.figures()
    else:
        figures = {"max_batch": 1, "size": worker.active, "decoding": worker.active, "running": []}
        figures["passes_by_batch_size"], figures["joining_passes"] = {}, None
    tokens, seconds = worker.decode_clock.read()
    figures["queued"] = worker.queued()
    figures["decode_tok_s"] = tokens / seconds if seconds > 0 else None
    return figures


def prometheus_text(health: dict) -> str:
    """`health` in the Prometheus text exposition format (0.0.4): # HELP and # TYPE before each metric."""
    c = health["expert_cache_stats"]
    prefetch = c["prefetch"]
    samples = {
        "expert_cache_hits_total": c["cache_hits"],
        "expert_cache_misses_total": c["cache_misses"],
        "expert_cache_hit_rate": c["hit_rate"],
        "expert_cache_decode_hit_rate": c["decode_hit_rate"],
        "expert_cache_prefill_hit_rate": c["prefill_hit_rate"],
        "expert_bytes_read_total": c["bytes_read"],
        "expert_stall_seconds_total": c["stall_s"],
        "expert_cache_resident": c["working_set_experts"],
        "model_decode_passes_total": c["decode_passes"],
        "model_decode_positions_total": c["decode_positions"],
        "expert_cache_decode_pass_experts_total": c["decode_per_pass"]["experts"],
        "expert_cache_decode_pass_hits_total": c["decode_per_pass"]["expert_hits"],
        "expert_cache_decode_routings_read_total": c["decode_per_pass"]["routings_read"],
        "expert_cache_decode_experts_per_layer_pass": c["decode_per_pass"]["experts_per_layer_pass"],
        "expert_cache_capacity": c["capacity"],
        "decode_experts_per_token": c["experts_per_token"],
        "draft_verify_passes_total": health["drafts"]["verify_passes"],
        "draft_tokens_total": health["drafts"]["drafted"],
        "draft_accepted_tokens_total": health["drafts"]["accepted"],
        "draft_acceptance_rate": health["drafts"]["acceptance_rate"],
        "expert_tier_experts": [({"tier": t}, n) for t, n in c["tiers"]["experts_per_layer"].items()],
        "expert_tier_lanes_total": [({"tier": t}, n) for t, n in c["tiers"]["lanes"].items()],
        "expert_disk_reads_total": c["tiers"]["disk"]["experts_read"],
        "expert_disk_bytes_read_total": c["tiers"]["disk"]["bytes_read"],
        "expert_disk_wait_seconds_total": c["tiers"]["disk"]["wait_s"],
        "expert_disk_reruns_total": c["tiers"]["disk"]["reruns"],
        "expert_disk_prefetch_reads_total": c["tiers"]["disk"]["prefetch_reads"],
        "expert_disk_prefetch_wasted_total": c["tiers"]["disk"]["prefetch_wasted"],
        "prefetch_precision": prefetch.get("precision"),
        "prefetch_issued_total": prefetch.get("issued"),
        "prefetch_late_total": prefetch.get("late"),
        "layer_hit_rate": [({"layer": str(i)}, r) for i, r in enumerate(c["per_layer_hit_rate"])],
        "up": 1 if health["status"] in ("ok", "degraded") else 0,
        "memory_peak_bytes": health["memory"].get("peak_bytes"),
        "memory_device_bytes": health["memory"].get("device_bytes"),
        "memory_host_bytes": health["memory"].get("host_bytes"),
        "uptime_seconds": health["uptime_s"],
        "batch_size": health["batch"]["size"],
        "batch_decoding": health["batch"]["decoding"],
        "batch_max": health["batch"]["max_batch"],
        "decode_tokens_per_second": health["batch"]["decode_tok_s"],
        "request_tokens_per_second": [
            ({"position": str(i)}, r["tok_s"]) for i, r in enumerate(health["batch"]["running"])
        ],
    }
    for key, field in (
        ("rank_decode_hit_rate", "decode_hit_rate"),
        ("rank_expert_bytes_read_total", "bytes_read"),
    ):
        samples[key] = [({"rank": str(r["rank"])}, r.get(field)) for r in health["ranks"] or ()]
    samples["rank_up"] = [({"rank": str(r["rank"])}, int(r["state"] == "ok")) for r in health["ranks"] or ()]
    for k, v in health["requests"].items():  # counters end in _total, as Prometheus names them
        samples[f"requests_{k}" if k in ("total", "active", "queued") else f"requests_{k}_total"] = v
    lines = []
    for key, (kind, text) in METRICS.items():
        value = samples.get(key)
        rows = value if isinstance(value, list) else [({}, value)]
        lines += [f"# HELP od_moe_{key} {text}", f"# TYPE od_moe_{key} {kind}"]
        for labels, v in rows:  # a rate with nothing counted yet is NaN, as Prometheus writes it
            label = "{" + ",".join(f'{k}="{x}"' for k, x in labels.items()) + "}" if labels else ""
            lines.append(f"od_moe_{key}{label} {'NaN' if v is None else repr(float(v))}")
    return "\n".join(lines) + "\n"
