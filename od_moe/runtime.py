"""Per-model offload runtime: the clock, reads into the caches, and the work done between tokens.

Every `OffloadedSwitch` of a model shares one runtime. It
- advances a clock per forward pass (the first MoE layer calls `begin_forward`), which is also the
  cooperative point "between tokens": deferred bookkeeping of the previous pass runs there;
- reads experts through the store in staging-buffer chunks and installs them (`load`), timing the read
  (stall) and the copy (install) separately;
- keeps lazily recorded routing of passes that needed no sync (skip mode, fully resident layers) and
  accounts for it later (`settle`); in skip mode the missed experts are loaded then, so later tokens hit.
Everything here runs on the generation thread. Not here: the forward math (`switch.py`).
"""

import time
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .cache import LayerCache, Origin
from .store import ExpertStore, Staging

MISS_POLICIES = ("load", "skip")
READ_BATCH = 16  # experts per read round at most...
STAGING_BYTES = 8 * 2**20  # ...and at most this many bytes: staging and install copies count against budgets


class OffloadRuntime:
    def __init__(self, store: ExpertStore, miss_policy: str = "load"):
        if miss_policy not in MISS_POLICIES:
            raise ValueError(f"unknown miss policy {miss_policy!r}")
        self.store = store
        self.miss_policy = miss_policy
        self.clock = 0
        self.tokens = {"prefill": 0, "decode": 0}
        self.forwards = 0
        self.phase = "prefill"
        self.io = empty_io()
        self._deferred: List[Tuple[object, mx.array, str]] = []
        self._staging: Dict[tuple, Staging] = {}
        self.prefetcher = None  # a PrefetchQueue when a prefetch policy is on
        self.policy = None  # what predicts experts ahead (policies.py); None: on-demand only
        self.policy_name = "none"
        self.segment = 1  # predict at every `segment`-th MoE layer
        self.profile_counts: Optional[List[np.ndarray]] = None  # the prompt's routing (profile policy)
        self.recording: Optional[List[Dict[int, np.ndarray]]] = None  # routing per forward (oracle traces)
        self.generation_forward = 0
        self._forward_start = None
        self._caches: List[LayerCache] = []
        self.top_k = 1  # experts per token (set by the engine)

    # -- between tokens --------------------------------------------------------------------------
    def begin_forward(self, n_tokens: int, phase: str):
        """Called by the first MoE layer of every forward pass, before it computes."""
        self.settle()
        now = time.perf_counter()
        if self.prefetcher is not None:  # between tokens: the cooperative install point
            self.prefetcher.end_token(self.phase, now - self._forward_start if self._forward_start else None)
            self.prefetcher.install_ready(clock=self.clock)
        if self.profile_counts is not None and phase == "decode" and self.phase == "prefill":
            from .policies import seed_from_profile

            seed_from_profile(self, self._caches, self.profile_counts, self.top_k)
        self.phase = phase
        self._forward_start = now
        self.clock += 1
        self.forwards += 1
        self.tokens[phase] += n_tokens
        if self.recording is not None:
            self.recording.append({})
        if hasattr(self.policy, "forward"):
            self.policy.forward = self.generation_forward
        self.generation_forward += 1

    def account(self, nbytes: int, stall_s: float):
        """Reads and waits of the prefetcher, booked to the phase of the running pass."""
        io = self.io[self.phase]
        io["bytes_read"] += nbytes
        io["stall_s"] += stall_s

    def start_generation(self):
        """A new prompt: forward passes count from zero again (oracle traces are indexed by them)."""
        self.generation_forward = 0
        self._forward_start = None  # the time between two prompts is not a token's
        if self.policy_name == "profile":
            self.profile_counts = [np.zeros(c.num_experts, np.int64) for c in self._caches]

    def observe(self, layer: int, ids: np.ndarray, phase: str):
        """A layer's routing, once known: kept for oracle traces and the prompt profile."""
        if self.recording is not None and self.recording:
            self.recording[-1][layer] = ids.reshape(-1, ids.shape[-1])
        if self.profile_counts is not None and phase == "prefill":
            self.profile_counts[layer] += np.bincount(ids.ravel(), minlength=len(self.profile_counts[layer]))

    def predict(self, switch, x: mx.array, phase: str) -> list:
        """Predictions of the prefetch policy at this layer (decode only, every `segment` layers and the last)."""
        if self.policy is None or phase != "decode" or not hasattr(self.policy, "predict"):
            return []
        if self.prefetcher is not None and not self.prefetcher.active:
            return []  # backed off or paused: predicting would cost without reading anything
        if switch.index % self.segment and switch.index != len(self._switches) - 1:
            return []  # the last layer always predicts: it alone sees the next token coming
        t0 = time.perf_counter()
        predictions = self.policy.predict(switch.index, x, switch.last_gate_output, self._switches)
        if self.prefetcher is not None:
            self.prefetcher.busy_s += time.perf_counter() - t0
        return predictions

    def evaluate(self, indices: mx.array, predictions: list):
        """Evaluate a layer's routing with the predictions made at it (one sync); while the prefetcher
        measures what it costs, the predictions' compute is timed apart (a second sync)."""
        lazy = [a for p in predictions for a in p[1:] if isinstance(a, mx.array)]
        if lazy and self.prefetcher is not None and self.prefetcher.measuring:
            mx.eval(indices)
            t0 = time.perf_counter()
            mx.eval(lazy)
            self.prefetcher.busy_s += time.perf_counter() - t0
        else:
            mx.eval(indices, lazy)

    def defer(self, switch, indices: mx.array, phase: str):
        """Keep a layer's routing (lazy) to account for after the pass is evaluated."""
        self._deferred.append((switch, indices, phase))

    def settle(self):
        """Account for deferred routing; in skip mode, load what missed so later tokens hit."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        mx.eval([indices for _, indices, _ in deferred])
        for switch, indices, phase in deferred:
            cache = switch.cache
            ids = np.array(indices).astype(np.int64)
            self.observe(switch.index, ids, phase)
            uniq, counts = np.unique(ids, return_counts=True)
            resident = cache.slot_of[uniq] >= 0
            cache.record_lookups(phase, ids.size, counts[resident].sum())
            cache.touch(uniq[resident], counts[resident], self.clock)
            missing = uniq[~resident]
            if missing.size and self.miss_policy == "skip":
                most_used_first = missing[np.argsort(-counts[~resident], kind="stable")]
                fit = most_used_first[: cache.room()]
                if fit.size:
                    self.load(cache, np.sort(fit), Origin.DEMAND)

    # -- reads -----------------------------------------------------------------------------------
    def _staging_for(self, cache: LayerCache) -> Staging:
        key = tuple((p.proj, p.name, p.dtype, tuple(p.shape)) for p in cache.layout.parts)
        staging = self._staging.get(key)
        if staging is None:
            size = max(1, min(READ_BATCH, STAGING_BYTES // cache.layout.expert_nbytes))
            staging = self._staging[key] = Staging(cache.layout, size)
        return staging

    def load(self, cache: LayerCache, ids: Sequence[int], origin: Origin, protect: Sequence[int] = ()):
        """Read experts `ids` of `cache`'s layer from disk and install them (synchronously)."""
        ids = np.asarray(ids, dtype=np.int64)
        staging = self._staging_for(cache)
        keep = list(protect) + ids.tolist()
        for start in range(0, len(ids), staging.size):
            chunk = ids[start:start + staging.size]
            before = self.store.bytes_read
            t0 = time.perf_counter()
            raw = self.store.read(cache.layout, chunk, staging)
            t1 = time.perf_counter()
            cache.install(chunk, raw, origin, protect=keep, clock=self.clock)
            t2 = time.perf_counter()
            stats = cache.stats
            stats.stall_s += t1 - t0
            stats.install_s += t2 - t1
            stats.bytes_read += self.store.bytes_read - before
            stats.experts_loaded += len(chunk)
            io = self.io[self.phase]
            io["bytes_read"] += self.store.bytes_read - before
            io["stall_s"] += t1 - t0
            io["install_s"] += t2 - t1


def empty_io() -> Dict[str, Dict[str, float]]:
    """Reads by the phase of the pass that caused them (deferred skip-mode loads count to the next pass)."""
    return {phase: {"bytes_read": 0, "stall_s": 0.0, "install_s": 0.0} for phase in ("prefill", "decode")}
