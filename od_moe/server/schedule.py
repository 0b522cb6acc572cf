"""The running batch's schedule, as the server's worker ran it, and its replay through mlx-lm.

A `ScheduleLog` records, step by step (one step: one call of mlx-lm's `BatchGenerator.next()`), which
sequences joined the batch (their prompt tokens, token limit, sampling settings, and the kept KV cache
they started from, if any), which left it before
the generator ended them (a stop string matched, the client went away), when the generator was made anew
(after a failed step), and the tokens each sequence was given. `replay` drives mlx-lm's own
`BatchGenerator` over any model (the stock mlx-lm model, in the tests) through the same joins and leaves
at the same steps and returns each sequence's tokens: in exact mode, and for greedy sequences, they must
be the tokens the server gave. The log is kept in memory, only when a server is asked to keep it.
Not here: running the batch (`batching.py`), HTTP (`app.py`).
"""

import threading
from dataclasses import dataclass, field

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import trim_prompt_cache


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
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def join(self, entry: Join):
        with self.lock:
            self.joins.append(entry)
            self.tokens[entry.uid], self.token_steps[entry.uid] = [], []

    def leave(self, step: int, uid: int):
        with self.lock:
            self.leaves.append((step, uid))

    def reset(self, step: int):
        with self.lock:
            self.resets.append(step)

    def token(self, uid: int, token: int, step: int):
        with self.lock:
            self.tokens[uid].append(token)
            self.token_steps[uid].append(step)

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
    generator, ours, running = None, {}, set()  # ours: the replaying generator's uid -> the logged uid
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
