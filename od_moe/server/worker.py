"""The generation worker: one thread that owns the engine and runs the requests, in order of arrival.

With `max_batch` 1 it runs them one at a time; above 1 up to `max_batch` decode together, joining and
leaving between decode steps (`batching.py`), those still being read when others join waited for
(`arrivals.py`). MLX work stays on this thread (the engine may even be loaded
on it). Each job streams events to its own queue: ("text", str) pieces, then ("done", finish_reason,
usage, matched stop string or None) or ("error", ApiError). A job whose client went away is cancelled and
its generation stopped at the next token or, during a long prompt, at the next prefill chunk. The KV
cache of the request that ended last is kept with the tokens it holds and reused for the longest common
token prefix of the next prompt; a failed or cancelled request drops the cache it took, so it is never
reused wrongly. `shutdown` ends the running and queued jobs with an error event and waits for the
thread, so no MLX work is under way when the process exits.
Across ranks (`ranks.py`) a worker on every rank runs each job rank 0 announces (`announce`), one at a
time, with every cancellation check decided by rank 0 (`lockstep`); a rank gone ends them with a 503.
Not here: HTTP (`app.py`).
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import RankLost, UserError
from . import one_at_a_time
from .arrivals import Arrival, Arrivals
from .batching import RunningBatch, fitting_batch
from .decode_clock import DecodeClock
from .drafting import ServerDraft
from .one_at_a_time import Cancelled
from .prompt_cache import PromptCache
from .requests import ApiError, GenerationParams
from .schedule import ScheduleLog


@dataclass
class Job:
    prompt: list[int]
    params: GenerationParams
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    alive: Callable[[], bool] = lambda: True  # False once the client has gone away
    submitted: float = field(default_factory=time.perf_counter)  # when it was queued
    release: Callable[[], None] = lambda: None  # gives back what it holds (`kv_room.py`); idempotent

    def stream(self, timeout_s: float, poll_s: float = 0.2):
        """The job's events until its last one. A worker silent for `timeout_s` cancels it; so does a
        client found gone (checked every `poll_s` while waiting), and then the events just end."""
        try:
            yield from self._events(timeout_s, poll_s)
        finally:  # the reply has ended, or its client went away
            self.release()

    def _events(self, timeout_s: float, poll_s: float):
        silent_since = checked = time.monotonic()
        while True:
            try:
                event = self.events.get(timeout=poll_s)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if now - checked >= poll_s:  # also while events keep coming: a body is sent only at the end
                checked = now
                if not self.alive():
                    self.cancelled.set()
                    return
            if event is None:
                if now - silent_since > timeout_s:
                    self.cancelled.set()
                    raise ApiError(504, "generation timed out", kind="server_error")
                continue
            silent_since = now
            yield event
            if event[0] != "text":
                return


class GenerationWorker:
    """The thread that owns the engine; `prefill_step` tokens are prefilled between cancellation checks;
    `max_batch` requests decode together (1: one at a time, with prompt-cache reuse); `schedule`, if given,
    logs the batch's schedule (`schedule.py`); `drafting`: a draft model for every request (`drafting.py`)."""

    def __init__(
        self,
        engine=None,
        loader: Callable | None = None,
        prefill_step: int = 256,
        max_batch: int = 1,
        schedule: ScheduleLog | None = None,
        drafting: ServerDraft | None = None,
    ):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise UserError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.engine = engine
        self.prefill_step = prefill_step
        self.max_batch, self.schedule = max_batch, schedule
        self.batch: RunningBatch | None = None
        self.batch_cut: str | None = None  # why max_batch was cut to what memory holds, if it was
        self.stopping = False
        self.failures_in_a_row = 0  # server errors (not user mistakes) since the last success
        self.last_error: str | None = None
        self.current: Job | None = None
        self.told_to_stop: list[Job] = []  # jobs ended by shutdown, whose relays may still be sending
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.arrivals = Arrivals()  # requests being read, not queued yet
        self.prompt_cache = PromptCache()
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.lock = threading.Lock()
        self.counters = {"total": 0, "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0}
        self.active = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.decode_clock = DecodeClock()
        self._loader = loader
        self.drafting = drafting or ServerDraft()
        self.announce: Callable | None = None  # across ranks (`ranks.py`)
        self.lockstep: Callable[[bool], bool] | None = None
        self.ranks = None  # rank 0's `ranks.Leader`: the other ranks' figures for /health
        self.broken: str | None = None  # why the pipeline can generate no more (a rank is gone)
        self.thread = threading.Thread(target=self._run, name="od-moe-generation", daemon=True)
        self.thread.start()

    # -- called from request threads ---------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: GenerationParams,
        alive: Callable[[], bool] | None = None,
        arrival: Arrival | None = None,
        release: Callable[[], None] | None = None,
    ) -> Job:
        """Queue a job; its `arrival` (`arrivals.py`) ends as it is queued, so that a batch waiting for
        the requests being read finds it there, or as it is refused; `release`: see `Job.release`."""
        job = Job(prompt, params, release=release or (lambda: None))
        if alive is not None:
            job.alive = alive
        with self.lock:
            self.counters["total"] += 1
            refused = self.broken is not None or self.stopping
            if self.broken is not None:
                self.counters["failed"] += 1
                job.events.put(("error", _broken(self.broken)))
            elif self.stopping:
                self._tell_stopping(job)
        if arrival is not None:
            arrival.end(queue=None if refused else lambda: self.jobs.put(job))
        elif not refused:
            self.jobs.put(job)
        return job

    def queued(self) -> int:
        return self.jobs.qsize()

    def state(self) -> str:
        """ "loading" (until the engine is loaded, warmed up and its batch built), "ok", "degraded" (the last
        request failed on the server's side), "stopping" or "error"."""
        if self.load_error is not None or not self.thread.is_alive() or self.broken is not None:
            return "error"
        if self.stopping:
            return "stopping"
        if not self.ready.is_set():
            return "loading"
        return "degraded" if self.failures_in_a_row else "ok"

    def stop(self):
        self.jobs.put(None)

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """End the running and queued jobs with an error event, stop the thread and wait for it (True
        when it has finished: no MLX work is left running; never where a rank is gone, as the thread may be
        blocked in a collective, nor while it loads, which cannot be stopped midway)."""
        if self.broken is not None:
            return False
        with self.lock:
            self.stopping = True
            running = [self.current] if self.current is not None else []
        for job in running + (self.batch.jobs() if self.batch is not None else []):
            job.cancelled.set()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._tell_stopping(job)
        self.jobs.put(None)  # where it still loads, the thread ends once it has loaded
        if not self.ready.is_set():
            return False
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    # -- the worker thread --------------------------------------------------------------------------
    def _run(self):
        try:
            self._start()
        except BaseException as e:  # raised by create_app, and so by serve(), which then exits
            self.load_error = e
            return
        finally:
            self.ready.set()
        if self.batch is not None:
            return self._serve_batches()
        while (job := self.jobs.get()) is not None:
            if self.skipped(job):
                continue
            with self.lock:
                self.active, self.current = 1, job
            try:
                try:
                    outcome = one_at_a_time.generate(self, job)
                except Cancelled:
                    self.prompt_cache = PromptCache()
                    outcome = "cancelled"
            except RankLost as e:
                self.break_pipeline(str(e), job)
            except Exception as e:
                self.prompt_cache = PromptCache()
                self.finish(job, "failed", error=e)
            else:
                self._count(outcome)
                if outcome == "completed":
                    with self.lock:
                        self.failures_in_a_row = 0
                elif self.stopping:  # the client is still there: tell it why the text stops
                    self._tell_stopping(job)
            finally:
                self.decode_clock.stop()
                with self.lock:
                    self.active, self.current = 0, None

    def _start(self):
        """Everything before the first request: the engine (loaded and warmed up here where a `loader` was
        given), the draft, and the batch (its kernels compiled)."""
        if self.engine is None:
            self.engine = self._loader()
        self.drafting.load(self.engine)
        if self.max_batch > 1 and self.drafting.draft is not None:  # as in mlx-lm's server
            self.max_batch, self.batch_cut = 1, self.drafting.batch_cut(self.max_batch)
        if self.max_batch > 1 and self.engine.stage is not None:
            self.batch_cut = (
                f"batching is off across ranks: one request at a time (--max-batch {self.max_batch})"
            )
            self.max_batch = 1
        if self.max_batch > 1:
            self.max_batch, self.batch_cut = fitting_batch(self.engine, self.max_batch)
        if self.max_batch > 1:
            self.batch = RunningBatch(self, self.max_batch, self.prefill_step, self.schedule)

    def _serve_batches(self):
        """Up to `max_batch` jobs decode together: waiting jobs join between steps while there is room,
        with the requests still being read when some join (`arrivals.py`)."""
        batch, ended = self.batch, False
        while not ended or len(batch):
            joined, ended = batch.join_queued(self.jobs, ended)
            if joined and batch.room() and self.arrivals.wait():
                ended = batch.join_queued(self.jobs, ended)[1]
            batch.drop_cancelled()
            with self.lock:
                self.active = len(batch)
            if len(batch):
                try:
                    batch.step()
                    if batch.decoding:
                        self.decode_clock.tick(batch.decoding)
                except Exception as e:
                    batch.fail(e)
            with self.lock:
                self.active = len(batch)
            if not len(batch):
                self.decode_clock.stop()
        with self.lock:
            self.active = 0

    def skipped(self, job: Job) -> bool:
        """True, and counted, for a job dropped before it starts: cancelled, or queued when shutdown began
        (its client is told why)."""
        if not (job.cancelled.is_set() or self.stopping):
            return False
        self._count("cancelled")
        job.release()
        if self.stopping:
            self._tell_stopping(job)
        return True

    def finish(self, job: Job, outcome: str, usage: dict | None = None, error: Exception | None = None):
        """Count a job's end: "completed" (with its usage), "cancelled" or "failed" (`error` is then sent
        to its client: a user's mistake as a 400, anything else as a 500 that degrades /health)."""
        self._count(outcome)
        job.release()
        if outcome == "completed":
            with self.lock:
                self.failures_in_a_row = 0
                self.prompt_tokens += usage["prompt_tokens"]
                self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                self.completion_tokens += usage["completion_tokens"]
        elif outcome == "cancelled" and self.stopping:  # the client is still there: tell it why
            self._tell_stopping(job)
        elif error is not None:
            user = isinstance(error, (ApiError, UserError))
            if not user:
                self.note_failure(error)
            if not isinstance(error, ApiError):
                kind = "invalid_request_error" if user else "server_error"
                error = ApiError(400 if user else 500, str(error), kind=kind)
            job.events.put(("error", error))

    def note_failure(self, error: BaseException):
        """A server error (not a user's mistake): /health says "degraded" and shows it until a request
        succeeds."""
        with self.lock:
            self.failures_in_a_row += 1
            self.last_error = str(error)

    def break_pipeline(self, message: str, running: Job | None = None):
        """A rank is gone (`distributed/heartbeat.py`): end the running, queued and later jobs with a 503
        saying so; /health says "error". From any thread (the generation thread may be blocked for good)."""
        with self.lock:
            first, self.broken = self.broken is None, self.broken or message
            self.last_error = self.broken
            ended = [running, self.current] + _drain(self.jobs)
        for job in {id(j): j for j in ended if j is not None}.values():  # once each, in order
            self._count("failed")
            job.release()
            job.events.put(("error", _broken(self.broken)))
        return first

    def _cancelled(self, job: Job) -> bool:
        """Whether the job's client went away: across ranks, as rank 0 found it (every rank checks at the
        same points and must decide alike)."""
        cancelled = job.cancelled.is_set()
        return self.lockstep(cancelled) if self.lockstep is not None else cancelled

    def _tell_stopping(self, job: Job):
        job.events.put(("error", _shutting_down()))
        self.told_to_stop.append(job)

    def _count(self, key):
        with self.lock:
            self.counters[key] += 1


def _shutting_down() -> ApiError:
    return ApiError(
        503, "the server is shutting down: send the request again once it is back", kind="server_error"
    )


def _broken(message: str) -> ApiError:
    return ApiError(503, f"{message} (this server generates nothing until then)", kind="server_error")


def _drain(jobs: queue.Queue) -> list:
    """The jobs waiting in `jobs`, taken out (up to a stop, which stays: the thread still ends there)."""
    taken = []
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return taken
        if job is None:
            jobs.put(None)
            return taken
        taken.append(job)
