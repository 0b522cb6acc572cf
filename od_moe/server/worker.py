"""The generation worker: one thread that owns the engine and runs requests one at a time, in order.

MLX work stays on this thread (the engine may even be loaded on it). Each job streams events to its own
queue: ("text", str) pieces, then ("done", finish_reason, usage, matched stop string or None) or
("error", ApiError). A job whose client
went away is cancelled and its generation stopped at the next token. The KV cache of the previous request
is kept with the tokens it holds and reused for the longest common token prefix of the next prompt; a
failed or cancelled request drops it, so it is never reused wrongly. Not here: HTTP (`app.py`).
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import UserError
from .requests import ApiError, GenerationParams


@dataclass
class Job:
    prompt: list[int]
    params: GenerationParams
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def stream(self, timeout_s: float):
        """The job's events until its last one; a worker silent for `timeout_s` cancels it."""
        while True:
            try:
                event = self.events.get(timeout=timeout_s)
            except queue.Empty:
                self.cancelled.set()
                raise ApiError(504, "generation timed out", kind="server_error")
            yield event
            if event[0] != "text":
                return


class PromptCache:
    """The KV cache left by the previous request and the tokens it holds."""

    def __init__(self):
        self.cache, self.tokens = None, []

    def take(self, model, prompt: list[int]):
        """(cache, tokens still to prefill, tokens reused) for `prompt`."""
        n = 0
        if self.cache is not None:
            limit = min(len(self.tokens), len(prompt) - 1)  # at least one prompt token must be fed
            while n < limit and self.tokens[n] == prompt[n]:
                n += 1
            if n < len(self.tokens) and not (can_trim_prompt_cache(self.cache) and n > 0):
                n = 0
        if n == 0:
            self.cache, self.tokens = make_prompt_cache(model), []
        elif n < len(self.tokens):
            trim_prompt_cache(self.cache, len(self.tokens) - n)
        cache, self.cache, self.tokens = self.cache, None, []  # held by the running request only
        return cache, prompt[n:], n

    def keep(self, cache, tokens: list[int]):
        offset = next((c.offset for c in cache if hasattr(c, "offset")), None)
        if offset is None or offset > len(tokens):
            return
        self.cache, self.tokens = cache, tokens[:offset]


class GenerationWorker:
    def __init__(self, engine=None, loader: Callable | None = None):
        self.engine = engine
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.prompt_cache = PromptCache()
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.lock = threading.Lock()
        self.counters = {"total": 0, "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0}
        self.active = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self._loader = loader
        self.thread = threading.Thread(target=self._run, name="od-moe-generation", daemon=True)
        self.thread.start()

    # -- called from request threads ---------------------------------------------------------------
    def submit(self, prompt: list[int], params: GenerationParams) -> Job:
        job = Job(prompt, params)
        with self.lock:
            self.counters["total"] += 1
        self.jobs.put(job)
        return job

    def queued(self) -> int:
        return self.jobs.qsize()

    def stop(self):
        self.jobs.put(None)

    # -- the worker thread --------------------------------------------------------------------------
    def _run(self):
        try:
            if self.engine is None:
                self.engine = self._loader()
        except BaseException as e:  # reported by serve(), which then exits
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self._count("cancelled")
                continue
            with self.lock:
                self.active = 1
            try:
                outcome = self._generate(job)
                self._count(outcome)
            except Exception as e:
                self.prompt_cache = PromptCache()
                self._count("failed")
                error = (
                    e
                    if isinstance(e, ApiError)
                    else ApiError(
                        400 if isinstance(e, UserError) else 500,
                        str(e),
                        kind="invalid_request_error" if isinstance(e, UserError) else "server_error",
                    )
                )
                job.events.put(("error", error))
            finally:
                with self.lock:
                    self.active = 0

    def _count(self, key):
        with self.lock:
            self.counters[key] += 1

    def _generate(self, job: Job) -> str:
        engine, p = self.engine, job.params
        cache, rest, reused = self.prompt_cache.take(engine.model, job.prompt)
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
        ):
            if job.cancelled.is_set():
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
        self.prompt_cache.keep(cache, list(job.prompt) + tokens)
        usage = {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(job.prompt) + len(tokens),
            "prompt_tokens_details": {"cached_tokens": reused},
            "generation_s": time.perf_counter() - start,
        }
        with self.lock:
            self.prompt_tokens += len(job.prompt)
            self.cached_tokens += reused
            self.completion_tokens += len(tokens)
        job.events.put(("done", finish, usage, matched))
        return "completed"
