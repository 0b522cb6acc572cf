"""Continuous batching for the server: the requests decoding together on the generation thread.

`RunningBatch` holds one mlx-lm `BatchGenerator` over the engine's model (as
`od_moe/generation/batch_generate.py` does) and the
requests in it. Requests join between steps (`admit`), and leave when mlx-lm ends them (the token limit, an
end-of-sequence token), when a stop string matches, or when their client goes away (`remove` at the next
step). One step is one `BatchGenerator.next()`: a decode pass of every decoding sequence and, while the batch
has room, one chunk of at most `prefill_step` prompt tokens of the sequences still prefilling (mlx-lm's own
schedule: a joining sequence's prompt is prefilled chunk by chunk between the running batch's decode passes;
its last prompt token runs as its own first pass, then it decodes with the others). A sequence's first token
is read at the end of the step that ran its first pass and its text sent then (`_first_tokens`), not a step
later when the generator gives it out: mlx-lm builds a sequence's next pass before reading its last token,
and where experts are missing, building a pass computes it (every layer's routing is read on the host), so
waiting would cost each joining request a whole pass of the batch before its first text. The tokens and the
schedule are the generator's either way. Each request's text, stop strings, finish reason and usage are made
exactly as the one-at-a-time path makes them (`worker.py`), and so is the prompt-cache reuse: the KV cache of
the request that ended last (by its limit, an end-of-sequence token or a stop string) is kept and a joining
request whose prompt shares a prefix with it starts from it (one cache kept, taken by one request). The
schedule can be logged (`schedule.py`) and replayed through mlx-lm. Per step, the decode lookups, misses and
experts read are booked by the number of sequences decoded.
Requests join from the worker's queue (`join_queued`). Not here: the thread, the queue and the wait for
requests still being read (`worker.py`, `arrivals.py`), HTTP (`app.py`).
"""

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from ..generation.sampling import make_sampler, vocab_size_of
from ..memory import backend
from ..memory.capacity import experts_per_token
from ..model_surgery.mlx_lm_private import pending_tokens
from .job import Job
from .prompt_cache import PromptCache
from .schedule import Join, ScheduleLog

FINISHED_KEPT = 16  # completed requests whose figures /health keeps
log = logging.getLogger("od_moe.server")  # the Flask app's logger: the server's log


@dataclass
class Sequence:
    """One request in the batch: its job, the text made so far and what has been sent."""

    job: "Job"
    uid: int  # the generator's
    logged: int  # in the schedule log: unique across generators (a failed step starts a new one)
    detokenizer: StreamingDetokenizer
    stops: list[str]
    hold: int  # characters held back while a stop string could still be matching
    reused: int = 0  # prompt tokens taken from a kept KV cache
    joined: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    early: int | None = None  # its first token, read and sent before the generator gave it out
    last_token: float | None = None
    text: str = ""
    sent: int = 0
    tokens: list[int] = field(default_factory=list)

    def came(self, now: float):
        """A token of it was given out at `now`."""
        self.first_token = self.first_token or now
        self.last_token = now

    def read_early(self, token: int, now: float):
        """Its first token, read at `now` before the generator gives it out, its text added."""
        self.first_token, self.early = now, token
        self.detokenizer.add_token(token)
        self.text += self.detokenizer.last_segment

    def add(self, token: int, finish_reason: str | None):
        """A token the generator gave out, its text added (a first token read early has been already)."""
        self.tokens.append(token)
        early, self.early = self.early, None
        if finish_reason != "stop" and early is None:
            self.detokenizer.add_token(token)
        if finish_reason is not None:
            self.detokenizer.finalize()
        self.text += self.detokenizer.last_segment

    def stop_found(self) -> tuple[int, str] | None:
        """(where, which) of the first stop string in the text not yet sent, or None."""
        found = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
        return min(found) if found else None

    def cut(self, at: int):
        """The text ends at `at` (where a stop string starts)."""
        self.text = self.text[:at]

    def send(self):
        """The text no stop string can still match across, sent."""
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        if safe > self.sent:
            self.job.events.put(("text", self.text[self.sent : safe]))
            self.sent = safe


def prefill_batch_size(max_batch: int) -> int:
    """How many joining sequences the batch prefills together."""
    return min(max_batch, 8)


def fitting_batch(engine, max_batch: int, available: int | None = None) -> tuple[int, str | None]:
    """`max_batch` bounded by memory: each running request may grow a KV cache over the model's whole
    context (prompt and completion), on top of the memory the engine was budgeted; as many fit as the
    memory available after loading holds (at least 1). (the batch size, why it was cut, or None)"""
    if engine.device_budget is not None:  # it keeps a KV cache for each of them: `kv_room.py` admits by it
        return max_batch, None
    per_request = engine.kv_nbytes_per_token * engine.max_positions
    available = backend.available_memory_bytes() if available is None else available
    fits = max(1, available // per_request) if per_request else max_batch
    if fits >= max_batch:
        return max_batch, None
    return fits, (
        f"--max-batch {max_batch} cut to {fits}: a request's KV cache over {engine.max_positions} positions "
        f"takes {per_request / 1e6:.0f} MB and {available / 1e6:.0f} MB are available"
    )


class RunningBatch:
    """The sequences decoding together, at most `max_batch`; `worker` ends their jobs (`finish`)."""

    first_token_early = True  # read a joining sequence's first token in the step of its first pass

    def __init__(self, worker, max_batch: int, prefill_step: int, schedule: ScheduleLog | None = None):
        self.worker, self.engine = worker, worker.engine
        self.max_batch, self.prefill_step = max_batch, prefill_step
        self.schedule = schedule
        self.prefill_batch = prefill_batch_size(max_batch)
        if schedule is not None:
            model, eos = str(self.engine.model_path), self.engine.tokenizer.eos_token_ids
            schedule.configure(max_batch, self.prefill_batch, prefill_step, model, eos)
        self.vocab = vocab_size_of(self.engine.model)
        self.eos = set(self.engine.tokenizer.eos_token_ids)
        self.sequences: dict[int, Sequence] = {}
        self.prompt_cache = PromptCache()  # the KV cache the request that ended last left
        self.kept_from: int | None = None  # the sequence whose KV cache `prompt_cache` holds
        self.steps = 0  # BatchGenerator.next() calls so far: the schedule's clock
        self.inserted = self.uid_base = 0  # sequences inserted; those before the generator (logged uids)
        self.decoding = 0  # sequences decoded in the last step
        self.lock = threading.Lock()  # guards `sequences` for readers on other threads
        self.passes: dict[int, dict[str, float]] = {}  # sequences decoded -> per-step decode counts
        # the last requests completed, as /health shows
        self.finished: deque[dict] = deque(maxlen=FINISHED_KEPT)
        self.generator = self._new_generator()
        # before any request (device-kept rows: their kernels, for every size up to a full batch's lanes)
        self.engine.runtime.prepare_batches(max_batch * experts_per_token(self.engine.model))

    def __len__(self) -> int:
        return len(self.sequences)

    def room(self) -> int:
        return self.max_batch - len(self.sequences)

    def jobs(self) -> list:
        with self.lock:
            return [s.job for s in self.sequences.values()]

    # -- joining and leaving ---------------------------------------------------------------------
    def admit(self, job):
        """Put a request in the batch; its prefill starts at the next step. A prompt that leaves no
        room for a token, or sampling settings that cannot be sampled with, raise a UserError."""
        p = job.params
        limit = self.engine.token_limit(len(job.prompt), p.max_tokens)
        sampler = make_sampler(p.temperature, p.top_p, p.top_k, 0.0, p.seed, self.vocab)
        if not self.sequences:
            self.engine.runtime.start_prompt(job.prompt)
        cache, rest, reused = self.prompt_cache.take(self.engine.model, list(job.prompt))
        kept_from, self.kept_from = self.kept_from if reused else None, None
        caches = {"caches": [cache], "all_tokens": [list(job.prompt[:reused])]} if reused else {}
        (uid,) = self.generator.insert([rest], [limit], samplers=[sampler], **caches)
        self.inserted += 1
        hold = max((len(s) for s in p.stop), default=1) - 1
        seq = Sequence(job, uid, self.uid_base + uid, self.engine.tokenizer.detokenizer, p.stop, hold, reused)
        with self.lock:
            self.sequences[uid] = seq
        if self.schedule is not None:
            settings = (p.temperature, p.top_p, p.top_k, p.seed, reused, kept_from)
            self.schedule.join(Join(self.steps, seq.logged, list(job.prompt), limit, *settings))

    def join_queued(self, jobs: queue.Queue, ended: bool) -> tuple[int, bool]:
        """Queued jobs join while there is room, waiting for one only where the batch is empty: (how many
        joined, whether the queue has ended)."""
        joined = 0
        while not ended and self.room():
            try:
                job = jobs.get() if not self.sequences else jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                ended = True
            elif not self.worker.skipped(job):
                try:
                    self.admit(job)
                    joined += 1
                except Exception as e:
                    self.worker.finish(job, "failed", error=e)
        return joined, ended

    def drop_cancelled(self):
        """Remove at once the sequences whose client went away (or that shutdown cancelled)."""
        gone = [s for s in self.sequences.values() if s.job.cancelled.is_set()]
        for seq in gone:
            self._remove(seq)
            self.worker.finish(seq.job, "cancelled")

    def fail(self, error: Exception):
        """A step failed: every sequence ends with `error`, and the batch starts over with a new generator
        (the failed one's caches are in an unknown state). The runtime is settled first; where that fails
        too, it is logged and the requests are told both. An error no request is left to be told of (the
        settling after the last one ended) is logged and shown on /health."""
        try:
            self.engine.runtime.settle()
        except Exception as e:  # the worker lives on to serve the next requests
            log.error("settling the expert cache after a failed step failed too", exc_info=e)
            error = RuntimeError(
                f"{error}; then settling the expert cache failed too ({type(e).__name__}: {e})"
            )
        told = list(self.sequences.values())
        for seq in told:
            with self.lock:
                del self.sequences[seq.uid]
            self.worker.finish(seq.job, "failed", error=error)
        if not told:
            log.error("the running batch failed with no request in it", exc_info=error)
            self.worker.note_failure(error)
        self.generator.close()
        self.generator, self.uid_base = self._new_generator(), self.inserted
        if self.schedule is not None:
            self.schedule.reset(self.steps)

    # -- one step --------------------------------------------------------------------------------
    def step(self):
        """One `BatchGenerator.next()`: a decode pass and a prefill chunk; each new token goes to its
        request, and requests that end leave."""
        ledger = self.engine.runtime.ledger
        before = _decode_counts(ledger)
        try:
            responses = self.generator.next()[1]
        finally:
            self.steps += 1
        self._book(len(responses), before, _decode_counts(ledger))
        self.decoding = len(responses)
        ledger.count_generated(len(responses))
        now = time.perf_counter()
        for r in responses:
            seq = self.sequences[r.uid]
            seq.came(now)
            self._deliver(seq, r)
        if self.first_token_early:
            self._first_tokens()
        if not self.sequences:
            self.engine.runtime.settle()
            backend.release_cached_memory()

    def _first_tokens(self):
        """Read the first token of the sequences whose first pass this step ran, and send its text (not an
        end-of-sequence token: that ends the sequence, which the generator reports with the next step)."""
        found = pending_tokens(self.generator)  # mlx-lm's own, read only
        if found is None:  # (another mlx-lm: its tokens come with the next step)
            return
        uids, pending = found
        joined = [
            (i, seq)
            for i, uid in enumerate(uids)
            if (seq := self.sequences.get(uid)) is not None and seq.first_token is None
        ]
        if not joined:
            return
        tokens = pending.tolist()  # the passes the step started, computed now
        now = time.perf_counter()
        for i, seq in joined:
            if tokens[i] in self.eos:
                continue
            seq.read_early(tokens[i], now)
            if seq.stop_found() is None:
                seq.send()  # a stop string that matched is found again when the token is given out

    def _deliver(self, seq: Sequence, response):
        """The token's text, cut at a stop string, sent once no stop string can still match across it."""
        if self.schedule is not None:
            self.schedule.token(seq.logged, response.token, self.steps - 1)
        seq.add(response.token, response.finish_reason)
        if (stop := seq.stop_found()) is not None:
            cut, matched = stop
            seq.cut(cut)
            if response.finish_reason is None:
                self._keep(seq, *self._remove(seq, keep_cache=True))
            else:
                self._keep(seq, response.prompt_cache, response.all_tokens)
            return self._done(seq, "stop", matched)
        seq.send()
        if response.finish_reason is not None:
            self._keep(seq, response.prompt_cache, response.all_tokens)
            self._done(seq, response.finish_reason, None)

    def _done(self, seq: Sequence, finish: str, matched: str | None):
        if len(seq.text) > seq.sent:
            seq.job.events.put(("text", seq.text[seq.sent :]))
        n, prompt = len(seq.tokens), len(seq.job.prompt)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": seq.reused},
            "generation_s": time.perf_counter() - seq.joined,
        }
        self.worker.finish(seq.job, "completed", usage=usage)
        seq.job.events.put(("done", finish, usage, matched))
        with self.lock:
            self.finished.append(
                dict(_request(seq, time.perf_counter()), state="finished", finish_reason=finish)
            )

    def _remove(self, seq: Sequence, keep_cache: bool = False):
        """Take a sequence the generator still runs out of it (logged: the replay removes it too); with
        `keep_cache`, its (KV cache, the tokens it holds)."""
        caches = self.generator.remove([seq.uid], return_prompt_caches=keep_cache)
        if self.schedule is not None:
            self.schedule.leave(self.steps, seq.logged)
        self._forget(seq)
        return caches.get(seq.uid, (None, []))

    def _keep(self, seq: Sequence, cache, tokens):
        """A sequence ended well: its KV cache is the one the next joining request may start from."""
        self._forget(seq)
        if cache is not None:
            self.kept_from = seq.logged if self.prompt_cache.keep(cache, list(tokens)) else None

    def _forget(self, seq: Sequence):
        with self.lock:
            self.sequences.pop(seq.uid, None)

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.engine.forward,
            stop_tokens=[[t] for t in self.engine.tokenizer.eos_token_ids],
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.prefill_batch,
            prefill_step_size=self.prefill_step,
        )

    # -- what /health shows ----------------------------------------------------------------------
    def _book(self, decoded: int, before: tuple, after: tuple):
        """Book a step's decode counts by the tokens it gave out: by batch size, or, where it gave none,
        as a joining step (only joining sequences' first passes ran, whose tokens come with the next
        step)."""
        if not decoded and after == before:
            return
        row = self.passes.setdefault(decoded, dict.fromkeys(("steps",) + BOOKED, 0))
        row["steps"] += 1
        for key, a, b in zip(BOOKED, before, after):
            row[key] += b - a

    def figures(self, now: float | None = None) -> dict:
        """The batch as /health shows it: sizes, each request's figures, and the per-step booking."""
        now = time.perf_counter() if now is None else now
        with self.lock:
            sequences = list(self.sequences.values())
            passes = {str(k): _per_layer_pass(v) for k, v in sorted(self.passes.items()) if k}
            joining = _per_layer_pass(self.passes[0]) if 0 in self.passes else None
        running = [_request(s, now) for s in sequences]
        with self.lock:
            finished = list(self.finished)
        return {
            "max_batch": self.max_batch,
            "size": len(sequences),
            "decoding": sum(r["state"] == "decoding" for r in running),
            "steps": self.steps,
            "running": running,
            "finished": finished,
            "passes_by_batch_size": passes,
            "joining_passes": joining,
        }


# a step's decode counts, booked by the sequences it decoded: lookups (one per sequence and routed expert),
# misses among them, experts read (once for the batch), and per pass: the distinct experts a layer's pass
# routed to (the batch's union), over the layer passes whose routing was read (`accounting/ledger.py`)
BOOKED = ("lookups", "misses", "experts_read", "experts", "routings_read")


def _decode_counts(ledger) -> tuple[float, ...]:
    """The `BOOKED` decode counts so far, all layers together."""
    lookups = ledger.total("lookups", "decode")
    misses = lookups - ledger.total("hits", "decode")
    rest = (ledger.total(name, "decode") for name in ("experts_read", "experts", "routings_read"))
    return (lookups, misses, *rest)


def _request(s: Sequence, now: float) -> dict:
    """One request's figures: its tokens, state, decode tok/s (from its first token to its last), the
    seconds it waited in the queue and from joining the batch to its first token."""
    given = len(s.tokens) + (s.early is not None)  # tokens whose text went out (or is held back)
    span = (s.last_token or now) - (s.first_token or now)
    return {
        "prompt_tokens": len(s.job.prompt),
        "completion_tokens": given,
        "state": "decoding" if s.first_token else "prefilling",
        "tok_s": (given - 1) / span if given > 1 and span > 0 else None,
        "queued_s": s.joined - s.job.submitted,
        "time_to_first_token_s": (s.first_token - s.joined) if s.first_token else None,
    }


def _per_layer_pass(row: dict) -> dict:
    """A booked row with the distinct experts a layer's pass routed to, on average (None: not read)."""
    routings = row["routings_read"]
    return dict(row, experts_per_layer_pass=row["experts"] / routings if routings else None)
