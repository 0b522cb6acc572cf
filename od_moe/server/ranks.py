"""Serving across ranks: rank 0 serves HTTP, the other ranks follow its requests pass for pass.

Under `mlx.launch`, `serve` loads the split model on every rank (`distributed/rank_split.py`); rank 0 binds
the port and runs the usual worker, which makes its `Leader` once the engine is loaded (`leading`); the others
run `follow`: a worker of their own with a `Follower`, fed with rank 0's requests.
Both run the same code on the same tokens, so every rank makes the same passes, sampling, stop-string and
prompt-cache decisions; the one thing only rank 0 knows, whether a client went away, it decides for all
(`Leader.lockstep`, at every cancellation check, before the ranks go on). The messages travel on the
ranks' heartbeat connections (`distributed/heartbeat.py`), in order: a job, its decisions, the next job...
Requests run one at a time across ranks (no batching: `serve` says so at start).

Each other rank sends its figures (layers, hit rate, bytes and experts read) with every beat; /health and
the live page show one row per rank (`Leader.rows`). A rank that is gone (its connection closed or it went
silent) ends the running and waiting requests with an error event and a 503, /health says "error" and
which rank; the other ranks stop (`distributed/heartbeat.py`). Not here: HTTP (`app.py`), the worker
(`worker.py`).
"""

import os
import queue
import sys
import time
from dataclasses import asdict

from .job import Job
from .requests import GenerationParams
from .worker import GenerationWorker


def rank_figures(engine) -> dict:
    """This rank's figures for /health, from the live ledger (any thread)."""
    stats = engine.stats(settle=False)
    total, stage = stats["total"], engine.stage
    return {
        "layers": [stage.start, stage.end - 1],
        "moe_layers": stats["moe_layers"],
        "capacity": stats["capacity"],
        "hit_rate": total["hit_rate"],
        "decode_hit_rate": total["decode"]["hit_rate"],
        "decode_lookups": total["decode"]["lookups"],
        "bytes_read": total["bytes_read"],
        "experts_read": total["experts_read"],
        "stall_s": total["stall_s"],
        "expert_cache_bytes": stats["memory"]["expert_cache_bytes"],
        "time": time.time(),
    }


def leading(worker: GenerationWorker, log=print) -> "Leader | None":
    """What `worker` runs across ranks with on rank 0 (`GenerationWorker`'s `across_ranks`, called once its
    engine is loaded): a `Leader` where the engine is split over ranks, else None."""
    return Leader(worker, log) if worker.engine.stage is not None else None


class Leader:
    """Rank 0's side: sends each job and decision to the other ranks, keeps their figures, and turns a
    lost rank into an error for clients and /health (`GenerationWorker.break_pipeline`)."""

    def __init__(self, worker: GenerationWorker, log=print):
        self.worker, self.log = worker, log
        self.supervisor = worker.engine.stage.supervisor
        self.ending = False
        self.supervisor.when_lost(self.lost)
        if self.supervisor.lost is not None:  # lost before serving started
            self.lost(self.supervisor.message)

    def announce(self, job: Job):
        self.supervisor.send({"k": "job", "prompt": list(job.prompt), "params": asdict(job.params)})

    def lockstep(self, cancelled: bool) -> bool:
        self.supervisor.send({"k": "go", "cancel": cancelled})
        return cancelled

    def lost(self, message: str):
        if not self.ending and self.worker.break_pipeline(message):
            self.log(f"od-moe: error: {message}")

    def failed(self, error: Exception):
        """A request failed on rank 0 mid-pass (an expert it could not read): the other ranks are left
        inside that pass, so the pipeline stops as if a rank were lost, and they end."""
        why = f"it failed during a request ({type(error).__name__}: {error}), leaving the ranks out of step"
        self.supervisor.send({"k": "lost", "rank": 0, "why": why})
        self.lost(f"rank 0 of {self.supervisor.size} stopped the pipeline: {why}; start every rank again")

    def end(self):
        """The server stops: the other ranks end too (once the worker has finished its job)."""
        self.ending = True
        self.supervisor.send({"k": "end"})

    def rows(self) -> list[dict]:
        """One row per rank: its state ("ok", "lost", "stopped": ended because another was lost,
        "starting": no figures yet) and figures (rank 0's live, the others' as of their last beat)."""
        supervisor, now = self.supervisor, time.time()
        lost = supervisor.lost[0] if supervisor.lost is not None else None
        rows = []
        for rank in range(supervisor.size):
            figures = rank_figures(self.worker.engine) if rank == 0 else supervisor.payloads.get(rank)
            figures = dict(figures) if figures is not None else None
            state = "ok" if figures is not None else "starting"
            if lost is not None and rank != 0:
                state = "lost" if rank == lost else "stopped"
            row = {"rank": rank, "state": state}
            if figures is not None:
                row.update(figures, age_s=max(0.0, now - figures.pop("time", now)))
            rows.append(row)
        return rows


class Follower:
    """Another rank's side: runs the jobs rank 0 sends, each cancellation check decided as rank 0 decided
    it (`decided`); a job that fails ends this rank (`_stop`)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.decisions: queue.Queue[bool] = queue.Queue()

    def announce(self, job: Job):
        pass  # rank 0's to send

    def lockstep(self, cancelled: bool) -> bool:
        return self.decisions.get()  # this rank's own finding is never set: its jobs have no client

    def decided(self, cancel: bool):
        """Rank 0's decision at the next cancellation check."""
        self.decisions.put(cancel)

    def failed(self, error: Exception):
        _stop(f"rank {self.rank} failed during a request ({error}): every rank stops")

    def rows(self) -> None:
        return None


def follow(engine, log=print):
    """Run rank 0's requests on this rank until rank 0 ends the server. Waiting for rank 0 is pipeline
    work: if rank 0 (or another rank) is gone, this process ends with one line
    (`distributed/heartbeat.py`)."""
    supervisor = engine.stage.supervisor
    supervisor.send_with_beats(lambda: rank_figures(engine))
    follower = Follower(engine.stage.rank)
    worker = GenerationWorker(engine, max_batch=1, across_ranks=lambda _worker: follower)
    log(
        f"od-moe: rank {engine.stage.rank} follows rank 0's requests (layers {engine.stage.start}-"
        f"{engine.stage.end - 1})"
    )
    with supervisor.busy():
        while True:
            _, message = supervisor.inbox.get()
            if message["k"] == "job":
                worker.submit(message["prompt"], GenerationParams(**message["params"]))
            elif message["k"] == "go":
                follower.decided(message["cancel"])
            elif message["k"] == "end":
                break
        worker.stop()
        worker.join()
    engine.close()


def _stop(message: str):
    """End this rank at once: its pass is left half done, and rank 0 finds it gone
    (`distributed/heartbeat.py`)."""
    print(f"od-moe: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)
