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
time, with every cancellation check decided by rank 0 (`cancelled`); a rank gone ends them with a 503.
What it runs with across ranks is made once the engine is loaded (`across_ranks`: it needs the engine).
Other modules reach the worker through its methods and read-only properties: the thread owns its state.
Not here: HTTP (`app.py`), a job's generation (`one_at_a_time.py`, `batching.py`).
"""

import queue
import threading
from collections.abc import Callable
from typing import Protocol

from ..errors import RankLost, UserError
from . import one_at_a_time
from .arrivals import Arrival, Arrivals
from .batching import RunningBatch, fitting_batch
from .decode_clock import DecodeClock
from .drafting import ServerDraft
from .job import Job
from .one_at_a_time import Cancelled
from .prompt_cache import PromptCache
from .requests import ApiError, GenerationParams
from .schedule import ScheduleLog


class AcrossRanks(Protocol):
    """What a worker serving across ranks calls (`ranks.py`: rank 0's `Leader`, another rank's `Follower`)."""

    def announce(self, job: Job) -> None:
        """Before `job` runs: rank 0 sends it to the other ranks."""

    def lockstep(self, cancelled: bool) -> bool:
        """At a cancellation check: whether the job is cancelled, as rank 0 found it (`cancelled`)."""

    def failed(self, error: Exception) -> None:
        """A job failed with a server error, its pass left half done: the ranks are out of step."""

    def rows(self) -> list[dict] | None:
        """One row per rank for /health (rank 0), None on the other ranks."""


class GenerationWorker:
    """The thread that owns the engine; `prefill_step` tokens are prefilled between cancellation checks;
    `max_batch` requests decode together (1: one at a time, with prompt-cache reuse); `schedule`, if given,
    logs the batch's schedule (`schedule.py`); `drafting`: a draft model for every request (`drafting.py`);
    `across_ranks`: given the worker once its engine is loaded, what it runs with across ranks, or None
    (`AcrossRanks`); `decode_clock`: the clock of its decode tok/s (`decode_clock.py`)."""

    def __init__(
        self,
        engine=None,
        loader: Callable | None = None,
        prefill_step: int = 256,
        max_batch: int = 1,
        schedule: ScheduleLog | None = None,
        drafting: ServerDraft | None = None,
        *,
        across_ranks: Callable[["GenerationWorker"], AcrossRanks | None] | None = None,
        decode_clock: DecodeClock | None = None,
    ):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise UserError(f"max_batch must be a positive integer, got {max_batch!r}")
        self._engine, self._loader = engine, loader
        self._prefill_step = prefill_step
        self._max_batch, self._schedule = max_batch, schedule
        self._drafting = drafting or ServerDraft()
        self._make_ranks, self._ranks = across_ranks, None
        self._batch: RunningBatch | None = None
        self._batch_cut: str | None = None  # why max_batch was cut to what memory holds, if it was
        self._stopping = False
        self._failures_in_a_row = 0  # server errors (not user mistakes) since the last success
        self._last_error: str | None = None
        self._broken: str | None = None  # why the pipeline can generate no more (a rank is gone)
        self._current: Job | None = None
        self._told_to_stop: list[Job] = []  # jobs ended by shutdown, whose relays may still be sending
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._arrivals = Arrivals()  # requests being read, not queued yet
        self._prompt_cache = PromptCache()  # one request at a time (the batch keeps its own)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._lock = threading.Lock()
        self._counters = {"total": 0, "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0}
        self._tokens = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0}
        self._active = 0
        self._decode_clock = decode_clock or DecodeClock()
        self._thread = threading.Thread(target=self._run, name="od-moe-generation", daemon=True)
        self._thread.start()

    # -- what it shows -----------------------------------------------------------------------------
    @property
    def engine(self):
        """The engine (None until `loader` has loaded it, or where loading failed)."""
        return self._engine

    @property
    def max_batch(self) -> int:
        """Requests decoded together: as asked, or as cut once the engine is loaded (`batch_cut`)."""
        return self._max_batch

    @property
    def batch_cut(self) -> str | None:
        """Why `max_batch` was cut at start (memory, a draft, ranks), or None."""
        return self._batch_cut

    @property
    def batch(self) -> RunningBatch | None:
        """The running batch (`batching.py`); None where requests run one at a time."""
        return self._batch

    @property
    def prefill_step(self) -> int:
        """Prompt tokens prefilled between cancellation checks."""
        return self._prefill_step

    @property
    def drafting(self) -> ServerDraft:
        """The draft every request drafts with (`drafting.py`; its `draft` None where there is none)."""
        return self._drafting

    @property
    def across_ranks(self) -> AcrossRanks | None:
        """What it runs with across ranks (rank 0's `ranks.Leader`), once loaded; None on one machine."""
        return self._ranks

    @property
    def ready(self) -> threading.Event:
        """Set once the engine is loaded, warmed up and its batch built, or loading failed (`load_error`)."""
        return self._ready

    @property
    def load_error(self) -> BaseException | None:
        """What loading raised (`create_app` raises it), or None."""
        return self._load_error

    @property
    def arrivals(self) -> Arrivals:
        """The requests being read on their HTTP threads (`arrivals.py`): each `begin`s there and ends as it
        is queued (`submit`) or refused; a batch about to prefill waits for them."""
        return self._arrivals

    @property
    def decode_clock(self) -> DecodeClock:
        """Tokens decoded and the seconds spent decoding them, read from any thread (`decode_clock.py`)."""
        return self._decode_clock

    @property
    def active(self) -> int:
        """Requests generating now (prefilling or decoding)."""
        return self._active

    @property
    def counters(self) -> dict[str, int]:
        """Requests by outcome (a copy): "total", "completed", "failed", "cancelled", "rejected"."""
        with self._lock:
            return dict(self._counters)

    @property
    def failures_in_a_row(self) -> int:
        """Server errors (not user mistakes) since the last request that succeeded."""
        return self._failures_in_a_row

    @property
    def last_error(self) -> str | None:
        """The last server error (or why the pipeline is broken), as /health shows it."""
        return self._last_error

    @property
    def broken(self) -> str | None:
        """Why the pipeline can generate no more (a rank is gone: `break_pipeline`), or None."""
        return self._broken

    @property
    def stopping(self) -> bool:
        """True once `shutdown` has begun."""
        return self._stopping

    def request_figures(self) -> dict:
        """/health's request figures, read together: the `counters`, requests "active" and "queued", and the
        tokens of completed requests ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")."""
        with self._lock:
            return dict(self._counters, active=self._active, queued=self.queued(), **self._tokens)

    def rank_rows(self) -> list[dict] | None:
        """Across ranks, one row per rank for /health (`ranks.Leader.rows`); None on one machine."""
        return self._ranks.rows() if self._ranks is not None else None

    def shutdown_relayed(self) -> bool:
        """Whether the request threads have taken the error event of every job `shutdown` ended."""
        return all(job.events.empty() for job in self._told_to_stop)

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
        job = Job(prompt, params, alive=alive or (lambda: True), release=release or (lambda: None))
        with self._lock:
            self._counters["total"] += 1
            refused = self._broken is not None or self._stopping
            if self._broken is not None:
                self._counters["failed"] += 1
                job.events.put(("error", _broken(self._broken)))
            elif self._stopping:
                self._tell_stopping(job)
        if arrival is not None:
            arrival.end(queue=None if refused else lambda: self._jobs.put(job))
        elif not refused:
            self._jobs.put(job)
        return job

    def count_rejected(self):
        """A request refused with an error (`requests.ApiError`, a 4xx) before it was queued."""
        self._count("rejected")

    def count_route_error(self):
        """A request whose route raised an unexpected error (answered with a 500), counted as failed."""
        self._count("failed")

    def queued(self) -> int:
        return self._jobs.qsize()

    def state(self) -> str:
        """ "loading" (until the engine is loaded, warmed up and its batch built), "ok", "degraded" (the last
        request failed on the server's side), "stopping" or "error"."""
        if self._load_error is not None or not self._thread.is_alive() or self._broken is not None:
            return "error"
        if self._stopping:
            return "stopping"
        if not self._ready.is_set():
            return "loading"
        return "degraded" if self._failures_in_a_row else "ok"

    def stop(self):
        self._jobs.put(None)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end (after `stop` or `shutdown`); True once it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """End the running and queued jobs with an error event, stop the thread and wait for it (True
        when it has finished: no MLX work is left running; never where a rank is gone, as the thread may be
        blocked in a collective, nor while it loads, which cannot be stopped midway)."""
        if self._broken is not None:
            return False
        with self._lock:
            self._stopping = True
            running = [self._current] if self._current is not None else []
        for job in running + (self._batch.jobs() if self._batch is not None else []):
            job.cancelled.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._tell_stopping(job)
        self._jobs.put(None)  # where it still loads, the thread ends once it has loaded
        if not self._ready.is_set():
            return False
        return self.join(timeout_s)

    # -- the worker thread --------------------------------------------------------------------------
    def _run(self):
        try:
            self._start()
        except BaseException as e:  # raised by create_app, and so by serve(), which then exits
            self._load_error = e
            return
        finally:
            self._ready.set()
        if self._batch is not None:
            return self._serve_batches()
        while (job := self._jobs.get()) is not None:
            if self.skipped(job):
                continue
            with self._lock:
                self._active, self._current = 1, job
            try:
                try:
                    outcome = one_at_a_time.generate(self, job, self._prompt_cache)
                except Cancelled:
                    self._prompt_cache = PromptCache()
                    outcome = "cancelled"
            except RankLost as e:
                self.break_pipeline(str(e), job)
            except Exception as e:
                self._prompt_cache = PromptCache()
                self.finish(job, "failed", error=e)
            else:
                self._count(outcome)
                if outcome == "completed":
                    with self._lock:
                        self._failures_in_a_row = 0
                elif self._stopping:  # the client is still there: tell it why the text stops
                    self._tell_stopping(job)
            finally:
                self._decode_clock.stop()
                with self._lock:
                    self._active, self._current = 0, None

    def _start(self):
        """Everything before the first request: the engine (loaded and warmed up here where a `loader` was
        given), the draft, the batch (its kernels compiled) and the other ranks' side."""
        if self._engine is None:
            self._engine = self._loader()
        self._drafting.load(self._engine)
        if self._max_batch > 1 and self._drafting.draft is not None:  # as in mlx-lm's server
            self._max_batch, self._batch_cut = 1, self._drafting.batch_cut(self._max_batch)
        if self._max_batch > 1 and self._engine.stage is not None:
            self._batch_cut = (
                f"batching is off across ranks: one request at a time (--max-batch {self._max_batch})"
            )
            self._max_batch = 1
        if self._max_batch > 1:
            self._max_batch, self._batch_cut = fitting_batch(self._engine, self._max_batch)
        if self._max_batch > 1:
            self._batch = RunningBatch(self, self._max_batch, self._prefill_step, self._schedule)
        if self._make_ranks is not None:
            self._ranks = self._make_ranks(self)

    def _serve_batches(self):
        """Up to `max_batch` jobs decode together: waiting jobs join between steps while there is room,
        with the requests still being read when some join (`arrivals.py`)."""
        batch, ended = self._batch, False
        while not ended or len(batch):
            joined, ended = batch.join_queued(self._jobs, ended)
            if joined and batch.room() and self._arrivals.wait():
                ended = batch.join_queued(self._jobs, ended)[1]
            batch.drop_cancelled()
            with self._lock:
                self._active = len(batch)
            if len(batch):
                try:
                    batch.step()
                    if batch.decoding:
                        self.count_decoded(batch.decoding)
                except Exception as e:
                    batch.fail(e)
            with self._lock:
                self._active = len(batch)
            if not len(batch):
                self._decode_clock.stop()
        with self._lock:
            self._active = 0

    # -- called on the worker thread by the paths that run jobs (`one_at_a_time.py`, `batching.py`) ------
    def skipped(self, job: Job) -> bool:
        """True, and counted, for a job dropped before it starts: cancelled, or queued when shutdown began
        (its client is told why)."""
        if not (job.cancelled.is_set() or self._stopping):
            return False
        self._count("cancelled")
        job.release()
        if self._stopping:
            self._tell_stopping(job)
        return True

    def announce(self, job: Job):
        """Before `job` runs alone: across ranks, rank 0 sends it to the other ranks."""
        if self._ranks is not None:
            self._ranks.announce(job)

    def cancelled(self, job: Job) -> bool:
        """Whether the job's client went away: across ranks, as rank 0 found it (every rank checks at the
        same points and must decide alike)."""
        cancelled = job.cancelled.is_set()
        return self._ranks.lockstep(cancelled) if self._ranks is not None else cancelled

    def count_decoded(self, tokens: int = 1):
        """A token was decoded (or a batch's pass decoded `tokens`): the decode clock ticks."""
        self._decode_clock.tick(tokens)

    def count_usage(self, usage: dict):
        """A completed job's tokens (its `usage`), for /health: counted before its "done" event is sent."""
        with self._lock:
            self._tokens["prompt_tokens"] += usage["prompt_tokens"]
            self._tokens["cached_prompt_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
            self._tokens["completion_tokens"] += usage["completion_tokens"]

    def finish(self, job: Job, outcome: str, usage: dict | None = None, error: Exception | None = None):
        """Count a job's end: "completed" (with its usage), "cancelled" or "failed" (`error` is then sent
        to its client: a user's mistake as a 400, anything else as a 500 that degrades /health and, across
        ranks, stops the pipeline: `AcrossRanks.failed`)."""
        self._count(outcome)
        job.release()
        if outcome == "completed":
            with self._lock:
                self._failures_in_a_row = 0
            assert usage is not None, "a completed job comes with its usage"
            self.count_usage(usage)
        elif outcome == "cancelled" and self._stopping:  # the client is still there: tell it why
            self._tell_stopping(job)
        elif error is not None:
            user = isinstance(error, (ApiError, UserError))
            if not user:
                self.note_failure(error)
            told = error
            if not isinstance(error, ApiError):
                kind = "invalid_request_error" if user else "server_error"
                told = ApiError(400 if user else 500, str(error), kind=kind)
            job.events.put(("error", told))
            if not user and self._ranks is not None:
                self._ranks.failed(error)

    def note_failure(self, error: BaseException):
        """A server error (not a user's mistake): /health says "degraded" and shows it until a request
        succeeds."""
        with self._lock:
            self._failures_in_a_row += 1
            self._last_error = str(error)

    # -- from any thread ------------------------------------------------------------------------------
    def break_pipeline(self, message: str, running: Job | None = None):
        """A rank is gone (`distributed/heartbeat.py`): end the running, queued and later jobs with a 503
        saying so; /health says "error". From any thread (the generation thread may be blocked for good)."""
        with self._lock:
            first, self._broken = self._broken is None, self._broken or message
            self._last_error = self._broken
            ended = [running, self._current] + _drain(self._jobs)
        for job in {id(j): j for j in ended if j is not None}.values():  # once each, in order
            self._count("failed")
            job.release()
            job.events.put(("error", _broken(self._broken)))
        return first

    def _tell_stopping(self, job: Job):
        job.events.put(("error", _shutting_down()))
        self._told_to_stop.append(job)

    def _count(self, key):
        with self._lock:
            self._counters[key] += 1


def _shutting_down() -> ApiError:
    return ApiError(
        503, "the server is shutting down: send the request again once it is back", kind="server_error"
    )


def _broken(message: str) -> ApiError:
    return ApiError(503, f"{message} (this server generates nothing until then)", kind="server_error")


def _drain(jobs: queue.Queue) -> list[Job]:
    """The jobs waiting in `jobs`, taken out (up to a stop, which stays: the thread still ends there)."""
    taken: list[Job] = []
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return taken
        if job is None:
            jobs.put(None)
            return taken
        taken.append(job)
