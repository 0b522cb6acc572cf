"""The running batch's schedule, as the server's worker ran it, and its replay through mlx-lm.

A `ScheduleLog` records, step by step (one step: one call of mlx-lm's `BatchGenerator.next()`), which
sequences joined the batch (their prompt tokens, token limit, sampling settings, and the kept KV cache
they started from, if any), which left it before the generator ended them (a stop string matched, the
client went away), when the generator was made anew (after a failed step), and the tokens each sequence
was given. `replay` drives mlx-lm's own `BatchGenerator` over any model (the stock mlx-lm model, in the
tests) through the same joins and leaves at the same steps and returns each sequence's tokens: in exact
mode, and for greedy sequences, they must be the tokens the server gave. The log is kept in memory, only
when a server is asked to keep it; with a `sink` (`od-moe serve --schedule-log PATH`) every event is also
written to a file as it happens, one JSON object a line (the generator's settings, the model and its
end-of-sequence tokens first), which `ScheduleLog.read` reads back and `python3 -m od_moe.server.schedule
PATH` replays through stock mlx-lm, saying whether every greedy sequence got its replayed tokens.
Not here: running the batch (`batching.py`), HTTP (`app.py`).
"""

import argparse
import json
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import TextIO

import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import trim_prompt_cache

from ..memory import backend


@dataclass
class Join:
    """A sequence entering the batch before step `step`."""

    step: int
    uid: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    reused: int = 0  # prompt tokens taken from the KV cache `cache_of` left (trimmed to them)
    cache_of: int | None = None


@dataclass
class ScheduleLog:
    """The generator's settings and what happened at each step; `tokens[uid]` the tokens given out."""

    completion_batch_size: int = 0
    prefill_batch_size: int = 0
    prefill_step_size: int = 0
    joins: list[Join] = field(default_factory=list)
    leaves: list[tuple[int, int]] = field(default_factory=list)  # (step, uid) removed by the worker
    resets: list[int] = field(default_factory=list)  # steps before which the generator was made anew
    tokens: dict[int, list[int]] = field(default_factory=dict)
    token_steps: dict[int, list[int]] = field(default_factory=dict)  # the step that gave each token
    model: str | None = None  # the model's folder and end-of-sequence tokens, for a replay from a file
    stop_tokens: list[int] = field(default_factory=list)
    sink: TextIO | None = field(default=None, repr=False)  # a text file each event is written to, if any
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def configure(self, completion: int, prefill: int, step_size: int, model: str, stop_tokens):
        """The generator's settings (before any step), and what a replay from the file needs."""
        with self.lock:
            self.completion_batch_size, self.prefill_batch_size = completion, prefill
            self.prefill_step_size, self.model, self.stop_tokens = step_size, model, list(stop_tokens)
            self._write(
                "settings",
                completion_batch_size=completion,
                prefill_batch_size=prefill,
                prefill_step_size=step_size,
                model=model,
                stop_tokens=self.stop_tokens,
            )

    def join(self, entry: Join):
        with self.lock:
            self.joins.append(entry)
            self.tokens[entry.uid], self.token_steps[entry.uid] = [], []
            self._write("join", **asdict(entry))

    def leave(self, step: int, uid: int):
        with self.lock:
            self.leaves.append((step, uid))
            self._write("leave", step=step, uid=uid)

    def reset(self, step: int):
        with self.lock:
            self.resets.append(step)
            self._write("reset", step=step)

    def token(self, uid: int, token: int, step: int):
        with self.lock:
            self.tokens[uid].append(token)
            self.token_steps[uid].append(step)
            self._write("token", uid=uid, token=token, step=step)

    def _write(self, event: str, **fields):
        if self.sink is not None:
            self.sink.write(json.dumps({"event": event, **fields}) + "\n")
            self.sink.flush()

    @classmethod
    def read(cls, path) -> "ScheduleLog":
        """The log a server wrote to `path` (`--schedule-log`)."""
        log = cls()
        with open(path) as f:
            for number, line in enumerate(f, 1):
                try:
                    entry = json.loads(line)
                    event = entry.pop("event")
                    if event == "settings":
                        log.configure(
                            entry["completion_batch_size"],
                            entry["prefill_batch_size"],
                            entry["prefill_step_size"],
                            entry["model"],
                            entry["stop_tokens"],
                        )
                    elif event == "join":
                        log.join(Join(**entry))
                    elif event == "leave":
                        log.leave(entry["step"], entry["uid"])
                    elif event == "reset":
                        log.reset(entry["step"])
                    else:
                        log.token(entry["uid"], entry["token"], entry["step"])
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}, line {number}: not a schedule log event ({e})") from None
        return log

    def prompts(self) -> dict[int, list[int]]:
        """uid -> prompt tokens."""
        with self.lock:
            return {j.uid: list(j.prompt) for j in self.joins}


def replay(model, log: ScheduleLog, stop_tokens) -> dict[int, list[int]]:
    """Each logged sequence's tokens when mlx-lm's `BatchGenerator` over `model` is driven through the
    logged joins, leaves and resets at the same steps (greedy sampling: compare greedy sequences only).
    `stop_tokens`: the end-of-sequence ids the server's generator stopped at."""
    with log.lock:
        joins, leaves, resets = list(log.joins), list(log.leaves), set(log.resets)
    last = max([j.step for j in joins] + [s for s, _ in leaves] + list(resets), default=-1)
    out: dict[int, list[int]] = {j.uid: [] for j in joins}
    kept = {}  # logged uid -> (KV cache, tokens) it ended with
    generator: BatchGenerator | None = None
    ours: dict[int, int] = {}  # the replaying generator's uid -> the logged uid
    running: set[int] = set()
    step = 0
    while step <= last or running:
        if generator is None or step in resets:
            generator, running = _generator(model, log, stop_tokens), set()
        gone = [u for u in running if (step, ours[u]) in leaves]  # first: a join may take a leaver's cache
        if gone:
            kept.update({ours[u]: c for u, c in generator.remove(gone, return_prompt_caches=True).items()})
            running.difference_update(gone)
        for j in (j for j in joins if j.step == step):
            uid = _insert(generator, j, kept)
            ours[uid] = j.uid
            running.add(uid)
        if running:
            for r in generator.next()[1]:
                out[ours[r.uid]].append(r.token)
                if r.finish_reason is not None:
                    running.discard(r.uid)
                    kept[ours[r.uid]] = (r.prompt_cache, r.all_tokens)
        step += 1
    return out


def _insert(generator: BatchGenerator, j: Join, kept: dict) -> int:
    """Put a logged join into the replaying generator, from the kept cache it started from (trimmed to
    the tokens it reused, as the server's `PromptCache.take` trims it); its uid there."""
    if not j.reused:
        return generator.insert([j.prompt], [j.max_tokens])[0]
    cache, _ = kept.pop(j.cache_of)
    held = next(c.offset for c in cache if hasattr(c, "offset"))
    if held > j.reused:
        trim_prompt_cache(cache, held - j.reused)
    rest = j.prompt[j.reused :]
    return generator.insert([rest], [j.max_tokens], caches=[cache], all_tokens=[j.prompt[: j.reused]])[0]


def _generator(model, log: ScheduleLog, stop_tokens) -> BatchGenerator:
    return BatchGenerator(
        model,
        stop_tokens=[[t] for t in stop_tokens],
        completion_batch_size=log.completion_batch_size,
        prefill_batch_size=log.prefill_batch_size,
        prefill_step_size=log.prefill_step_size,
    )


def main(argv=None) -> int:
    """Replay a schedule log a server wrote through stock mlx-lm: 0 when every greedy sequence got its
    replayed tokens, 1 when one did not."""
    parser = argparse.ArgumentParser(prog="python3 -m od_moe.server.schedule", description=main.__doc__)
    parser.add_argument("path", help="the file `od-moe serve --schedule-log PATH` wrote")
    parser.add_argument("--model", help="the model's folder (default: the one the log names)")
    args = parser.parse_args(argv)
    try:
        log = ScheduleLog.read(args.path)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    path = args.model or log.model
    if path is None:
        parser.error(f"{args.path} names no model: pass --model")
    model = mlx_lm.load(path)[0]
    dtype = backend.compute_dtype()
    if dtype is not None:  # as od-moe computes on this backend
        model.set_dtype(dtype)
    replayed = replay(model, log, log.stop_tokens)
    greedy = [j.uid for j in log.joins if j.temperature == 0]
    unequal = [u for u in greedy if replayed[u] != log.tokens[u]]
    print(
        f"{len(log.joins)} sequences, {len(greedy)} greedy: {len(greedy) - len(unequal)} got their replayed "
        f"tokens" + (f"; these did not: {unequal}" if unequal else "")
    )
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
