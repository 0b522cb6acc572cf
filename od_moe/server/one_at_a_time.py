"""One request at a time: a request's generation on the worker's thread, where requests do not decode
together (`--max-batch 1`, a draft model, or across ranks).

The KV cache the last request left is reused for the longest common token prefix of the prompt
(`prompt_cache.py`); text is sent as it comes, held back where a stop string may still match; the request is
cancelled at the next token, or between prefill chunks, once its client is gone (`Cancelled`). With a draft
model (`drafting.py`) the prompt cache holds the target's caches and the draft's, and mlx-lm drafts.
Not here: the thread, the queue and the counters (`worker.py`), requests decoded together (`batching.py`).
"""

import time

from .prompt_cache import PromptCache


class Cancelled(Exception):
    """Raised between prefill chunks when the job's client has gone away."""


def generate(worker, job, kept: PromptCache) -> str:
    """Run `job` on `worker`'s engine, its events to its queue, from the KV cache `kept` holds (the last
    request's, kept there after it): "completed" or "cancelled" (the cache dropped: it is not kept)."""
    engine, p = worker.engine, job.params
    cache, rest, reused = kept.take(worker.drafting.caches_of(engine), job.prompt)
    worker.announce(job)

    def between_chunks(done, total):
        if worker.cancelled(job):
            raise Cancelled  # the cache is dropped: it is not kept below

    stops, hold = p.stop, max((len(s) for s in p.stop), default=1) - 1
    text, sent, tokens, finish, matched = "", 0, [], "length", None
    start = time.perf_counter()
    for response in engine.stream_generate(
        rest,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        prompt_cache=cache,
        prefill_step_size=worker.prefill_step,
        prompt_progress_callback=between_chunks,
        **worker.drafting.options(p),
    ):
        worker.count_decoded()
        if worker.cancelled(job):
            return "cancelled"  # the cache is dropped: it is not kept below
        tokens.append(response.token)
        text += response.text
        found = [(i, s) for s in stops if (i := text.find(s, max(0, sent - len(s)))) >= 0]
        if found:
            cut, matched = min(found)
            text, finish = text[:cut], "stop"
            break
        if response.finish_reason == "stop":
            finish = "stop"
        safe = len(text) - hold if stops else len(text)
        if safe > sent:
            job.events.put(("text", text[sent:safe]))
            sent = safe
    if len(text) > sent:
        job.events.put(("text", text[sent:]))
    kept.keep(cache, list(job.prompt) + tokens)
    usage = {
        "prompt_tokens": len(job.prompt),
        "completion_tokens": len(tokens),
        "total_tokens": len(job.prompt) + len(tokens),
        "prompt_tokens_details": {"cached_tokens": reused},
        "generation_s": time.perf_counter() - start,
    }
    worker.count_usage(usage)
    job.events.put(("done", finish, usage, matched))
    return "completed"
