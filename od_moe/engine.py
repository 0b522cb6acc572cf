"""The engine: load an MoE model with a bounded expert cache and generate with it.

`load()` resolves and opens the model (`storage/model_files.py`: embedded default, local folder or hub id),
swaps every MoE block's experts for an `OffloadedSwitch` over a `LayerCache` (`assembly.py`), and materialises
only the non-expert weights. `Engine.stream_generate` runs mlx-lm's own generation loop on that model, so
responses are mlx-lm `GenerationResponse`s and exact mode's tokens are mlx-lm's. It also picks the prefetch
policy, reports the ledger (`stats`) and saves snapshots. Not here: the CLI, the server, the runtimes, reading
bytes.
"""

import contextlib
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationResponse, generation_stream

from .accounting.ledger import (
    PHASES,
    decode_figures,
    io_by_phase,
    layer_rows,
    per_pass,
    prefetch_counts,
    tier_figures,
    totals,
)
from .assembly import (
    attach_predictor,
    build_runtime,
    cache_for,
    check_policies,
    device_plan,
    eviction_predictor,
    place_experts,
    read_threads_of,
    say,
    settings_for_path,
)
from .caching.layer_cache import LayerCache
from .distributed import rank_split, seams
from .errors import ExpertReadError, UserError
from .generation import drafts
from .generation.sampling import make_sampler, vocab_size_of
from .memory import backend
from .memory.capacity import kv_nbytes_per_token
from .model_surgery.moe_blocks import find_moe_blocks, offloadable_blocks, top_k_of
from .model_surgery.routing import router_matrices, router_of
from .per_layer.settings import PerLayerSettings
from .prefetch.governor import PrefetchSettings
from .prefetch.policies import make_policy
from .progress import byte_progress
from .runtime import Runtime, TwoTierMode
from .storage.layout import BlockLayout
from .storage.model_files import (  # noqa: F401 (imported from here elsewhere)
    DEFAULT_MODEL,
    DEFAULT_PREDICTOR,
    max_positions,
    model_identity,
    open_model,
    open_store,
    resolve_model_path,
)
from .storage.store import ExpertStore
from .two_tier.settings import TwoTierSettings


class Engine:
    """An MoE model whose experts live in bounded per-layer caches, and its tokenizer."""

    def __init__(
        self,
        model,
        tokenizer,
        model_path: Path,
        runtime: Runtime,
        moe_blocks: list,
        identity: str,
        top_k: int,
        non_expert_nbytes: int,
        *,
        stage=None,
        capacity_choice: str | None = None,
        device_budget=None,
        kv_nbytes_per_token: int = 0,
    ):
        self.runtime = runtime  # first: `close` needs it
        self.model = model
        # what mlx-lm's generation loop calls: on the per-layer path, with optimistic decode passes
        self.forward = runtime.generation_model(model)
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.moe_blocks = moe_blocks  # the modules that hold each MoE layer's router and switch, in order
        self.identity = identity
        self.top_k = top_k
        self.non_expert_nbytes = non_expert_nbytes
        self.predictor = None
        self.policy_name = "none"
        self.load_peak_bytes = 0
        self.capacity_choice = capacity_choice  # where a device budget chose the slots: what and why (`load`)
        self.device_budget = (
            device_budget  # ((bytes, where from), Context) where the device's memory is its own
        )
        # KV cache a token of context takes (`capacity.kv_nbytes_per_token`)
        self.kv_nbytes_per_token = kv_nbytes_per_token
        self._routers: tuple | None = None
        self.max_positions = max_positions(model_path)
        self.stage = stage  # this rank's part of a pipeline over several processes (`rank_split.Stage`)
        self.seam_receiver = None  # the predictions the rank before sends (`distributed/seams.py`)

    @property
    def caches(self) -> list[LayerCache]:
        return self.runtime.caches

    @property
    def capacity(self) -> int:
        return self.caches[0].capacity

    @property
    def num_experts(self) -> int:
        return self.caches[0].num_experts

    @property
    def miss_policy(self) -> str:
        """The per-layer path's, "load" (exact) or "skip"; two tiers compute every miss exactly ("load")."""
        return self.runtime.miss_policy

    @property
    def mode(self) -> TwoTierMode:
        """Which path runs (`mode.path`: "per-layer" or "two-tier"); `mode_reason` says why."""
        return self.runtime.mode

    @property
    def mode_reason(self) -> str:
        """Why this path runs, as `load` decided it."""
        return self.runtime.mode_reason

    def routers(self) -> tuple:
        """The model's routers as dense float32 weights (L, E, H) and biases (L, E)."""
        if self._routers is None:
            self._routers = router_matrices(self.moe_blocks)
        return self._routers

    def router(self, layer: int):
        """The router module of one MoE layer."""
        return router_of(self.moe_blocks[layer])

    # -- generation ------------------------------------------------------------------------------
    def stream_generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        draft_model=None,
        num_draft_tokens: int | None = None,
        **kwargs,
    ) -> Generator[GenerationResponse, None, None]:
        """Yield mlx-lm `GenerationResponse`s for `prompt` (text or token ids).

        kwargs go to `mlx_lm.generate_step` (for example `prompt_cache`, `logits_processors`). `draft_model`
        (a model folder, loaded resident; an mlx-lm model; another engine) drafts `num_draft_tokens` a pass
        (None: mlx-lm's default) for mlx-lm's speculative decoding (`generation/drafts.py`; `from_draft` per
        response). Generation stops at the model's maximum positions (`max_positions`, prompt and reused cache
        included), with finish reason "length"; a prompt that leaves no room is a `UserError`.
        An expert that cannot be read fails the request with `ExpertReadError`; the engine stays usable,
        and a `prompt_cache` passed in is trimmed back to what it held before (where its caches can be
        trimmed; others must be made anew). Across ranks, a rank found gone fails it with `RankLost` (or
        ends the process where nothing else frees a collective: `distributed/heartbeat.py`).
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(prompt, str) and not prompt or isinstance(prompt, (list, tuple)) and not len(prompt):
            raise UserError("prompt is empty: give some text to continue")
        held = [getattr(c, "offset", None) for c in kwargs.get("prompt_cache") or ()]
        ids, draft = self.encode(prompt), drafts.prepare(self, draft_model, num_draft_tokens, kwargs)
        with self._pipeline_work():
            if self.stage is not None:  # every rank follows rank 0's prompt and samples with the same key
                ids, seed = self.stage.share_tokens(ids), self.stage.share_seed(seed)
            # the request's own random key: a failed or seeded request never touches another's sampling
            sampler = make_sampler(temperature, top_p, top_k, min_p, seed, vocab_size_of(self.model))
            context = max([o for o in held if o is not None], default=0) + len(ids)
            max_tokens = self.token_limit(context, max_tokens)
            yield from self._generate(ids, max_tokens, sampler, held, kwargs, draft)

    def _generate(self, prompt: list[int], max_tokens: int, sampler, held: list, kwargs: dict, draft=None):
        self.runtime.start_prompt(prompt)
        ledger, counted = self.runtime.ledger, 0
        try:  # drafted: the passes after the prompt's verify drafts (`drafts.Verifier`)
            for response in drafts.responses(self, draft, prompt, max_tokens, sampler, kwargs):
                # the last response repeats the count of the one before (it carries the finish reason)
                ledger.count_generated(response.generation_tokens - counted, response.from_draft)
                counted = response.generation_tokens
                yield response
        except ExpertReadError:  # layers before the failed one took the pass's tokens: take them back
            for c, offset in zip(kwargs.get("prompt_cache") or (), held):
                if offset is not None and c.offset > offset and c.is_trimmable():
                    c.trim(c.offset - offset)
            raise
        finally:
            self.runtime.settle() if draft is None else drafts.stop_verifying(self, draft)
            backend.release_cached_memory()
            if self.stage is not None:  # the pass computed ahead, on mlx-lm's stream, still talks to peers
                mx.synchronize(generation_stream)

    def _pipeline_work(self):
        """Across ranks, the heartbeat's watch over pipeline work (`heartbeat.Supervisor.busy`)."""
        return self.stage.supervisor.busy() if self.stage is not None else contextlib.nullcontext()

    def token_limit(self, context: int, max_tokens: int, which: str = "the prompt") -> int:
        """`max_tokens` capped where `context` tokens (prompt and reused cache) and the completion fill the
        model's positions; a UserError if the context leaves no room."""
        if context >= self.max_positions:
            raise UserError(
                f"{which} has {context} tokens and this model takes at most {self.max_positions} "
                "positions, prompt and completion together: shorten it"
            )
        return min(max_tokens, self.max_positions - context)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of `prompt`, encoded as `mlx_lm.stream_generate` encodes text (a BOS token added
        unless the text starts with one)."""
        if not isinstance(prompt, str):
            return prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
        bos = self.tokenizer.bos_token
        return self.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))

    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, **kwargs) -> str:
        """The whole completion of `prompt` as a string (other arguments as `stream_generate`'s)."""
        return "".join(r.text for r in self.stream_generate(prompt, max_tokens, temperature, **kwargs))

    def batch_generate(self, prompts, max_tokens: int | list[int] = 128, **kwargs):
        """The completions of several prompts decoded together, as `mlx_lm.batch_generate` returns them
        (`batch.batch_generate`: texts, statistics, token ids); misses are read once for the batch."""
        from .generation.batch_generate import batch_generate

        self._single_process("batched decoding")
        return batch_generate(self, prompts, max_tokens, **kwargs)

    def stream_batch_generate(self, prompts, max_tokens: int | list[int] = 128, **kwargs):
        """Yield each batch pass's new tokens, one `batch.BatchToken` per sequence decoded in it."""
        from .generation.batch_generate import stream_batch_generate

        self._single_process("batched decoding")
        return stream_batch_generate(self, prompts, max_tokens, **kwargs)

    def _single_process(self, what: str):
        if self.stage is not None:
            raise UserError(f"{what} does not run across ranks yet: run it in one process")

    def record_routing(self, prompt, max_tokens: int, **kwargs) -> list:
        """Generate and return the routing of every forward pass, [{layer: ids (tokens, k)}, ...]: what
        the oracle policy replays."""
        self.runtime.start_recording()
        try:
            for _ in self.stream_generate(prompt, max_tokens=max_tokens, **kwargs):
                pass
        finally:
            recording = self.runtime.stop_recording()
        assert recording is not None  # recording since `start_recording` above
        return recording

    def close(self):
        """Stop prefetch and the reader threads (the engine can still generate: demand reads restart them)."""
        self.runtime.close()
        self.policy_name = "none"

    def __del__(self):
        self.close()

    def start(self, predictor, prefetch, snapshot):
        """What `load` does once the engine is built: the predictor and prefetch policy, and the first
        resident set (a snapshot's, or every expert read once, layer by layer, where all of them have
        slots); then the load's peak memory is kept and the statistics zeroed, to describe generation."""
        if predictor is not None:
            self.predictor = attach_predictor(self, predictor)
        self.configure_prefetch(prefetch or ("predictor" if predictor is not None else "none"))
        if snapshot is not None:
            self.load_snapshot(snapshot)
        elif self.capacity == self.num_experts:
            _read_every_expert(self)
        self.load_peak_bytes = backend.peak_memory_bytes()
        self.reset_stats()

    # -- prefetch --------------------------------------------------------------------------------
    def configure_prefetch(self, policy: str, oracle_trace=None, settings: PrefetchSettings | None = None):
        """Choose what predicts experts ahead (see `prefetch/policies.py`): "none", "profile", "next-gate",
        "predictor" or "oracle" (which needs `oracle_trace`, the routing `record_routing` gave for the same
        prompt). `settings`: how the reader and the governor run (`PrefetchSettings`)."""
        if policy in ("next-gate", "predictor", "oracle") and self.miss_policy == "skip":
            raise UserError(
                f"prefetch policy {policy!r} needs miss_policy='load' (skip mode uses 'profile' or 'none')"
            )
        # across ranks: the seam too
        chosen, self.seam_receiver = seams.attach(self, make_policy(policy, self, oracle_trace))
        predicts = policy in ("next-gate", "predictor", "oracle")
        self.runtime.set_policy(chosen, (settings or PrefetchSettings()) if predicts else None, self.top_k)
        self.policy_name = policy

    # -- statistics ------------------------------------------------------------------------------
    def reset_stats(self):
        """Zero the counters (lookups, reads, stall, prefetch) and the peak memory; the cache stays."""
        self.runtime.reset_counts()
        backend.reset_peak_memory()

    def stats(self, settle: bool = True) -> dict:
        """Demand lookups, hits, misses, hit rate (prefill and decode apart), bytes read, stall seconds,
        resident experts and capacity, per layer and in total; prefetch; optimistic passes; memory. From
        the live ledger: `settle=False` reads it from any thread without touching MLX (routing not yet
        accounted for, at most one pass, is left out)."""
        runtime = self.runtime
        if settle:
            runtime.settle()
        ledger = runtime.ledger.snapshot()
        layers = layer_rows(ledger, self.caches)
        path = runtime.figures()
        prefetch = prefetch_counts(ledger, sum(c.unused_prefetch_count for c in self.caches))
        prefetch.update(path.prefetch)
        cache_bytes = sum(c.slot_nbytes * c.capacity for c in self.caches)
        return {
            "model": str(self.model_path),
            "model_identity": self.identity,
            "miss_policy": self.miss_policy,
            "eviction": self.caches[0].eviction,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "moe_layers": len(self.caches),
            "capacity": self.capacity,
            "capacity_fraction": self.capacity / self.num_experts,
            # positions the model computed (decode: passes) and tokens given to callers: see
            # accounting/ledger.py
            "positions": ledger.positions,
            "passes": ledger.passes,
            "generated_tokens": ledger.generated,
            # drafts (verify passes, drafted and accepted tokens) and experts moved per generated token
            **decode_figures(ledger, runtime.mode.tiered, path.kept_by_device),
            "io": io_by_phase(ledger),
            "tiers": tier_figures(ledger, path.tiers, path.host_eviction),
            "per_pass": {phase: per_pass(ledger, phase) for phase in PHASES},
            "direct_io": runtime.store.direct_io,
            "direct_io_refused": runtime.store.direct_io_refused,  # why reads go through the page cache
            "packed_experts": str(runtime.store.packed) if runtime.store.packed else None,
            "forwards": ledger.forwards,
            "layers": layers,
            "total": totals(layers),
            "prefetch": dict(prefetch, policy=self.policy_name),
            # decode passes run with one sync (`per_layer/optimistic.py`); none on two tiers
            "optimistic": {**path.optimistic, "host_syncs": runtime.host_syncs},
            "memory": {  # as the driver and the OS count them (`backend.memory_in_use`), then as MLX does
                **backend.memory_in_use(),
                "peak_bytes": backend.peak_memory_bytes(),
                "active_bytes": backend.active_memory_bytes(),
                "expert_cache_bytes": cache_bytes,
                "non_expert_bytes": self.non_expert_nbytes,
                "load_peak_bytes": self.load_peak_bytes,
            },
        }

    # -- warm start ------------------------------------------------------------------------------
    def save_snapshot(self, path, weights: bool = False):
        """Save which experts sit in which slots (and, with `weights`, their packed bytes)."""
        from .caching.snapshot import save_snapshot

        save_snapshot(self, path, weights=weights)

    def load_snapshot(self, path):
        """Restore a resident set saved for this model, capacity and predictor (else a UserError)."""
        from .caching.snapshot import load_snapshot

        load_snapshot(self, path)


def load(
    model: str | None = None,
    *,
    capacity=None,
    memory_budget=None,
    predictor=None,
    miss_policy: str = "load",
    eviction: str = "lru",
    snapshot=None,
    dtype: str = "auto",
    prefetch: str | None = None,
    direct_io: bool | str = "auto",
    read_threads: int | None = None,
    packed: bool | str = "auto",
    two_tier: bool | str = "auto",
    ranks="auto",
    device_memory=None,
    context_tokens: int | None = None,
    sequences: int = 1,
    path_settings: PerLayerSettings | TwoTierSettings | None = None,
) -> Engine:
    """Load an MoE model with a bounded expert cache.

    model: a local folder (MLX or Hugging Face layout), a hub id where there is network, or None for the
        embedded default. capacity: experts per layer (int), a fraction (0.25) or "25%"; memory_budget:
        bytes or "8GB" for the whole engine (None and no capacity: 70% of available memory).
    miss_policy: "load" (exact) or "skip" (approximate). eviction: "lru" or "lfu".
    predictor: a shadow predictor folder written by `od-moe train-predictor` (checked against this model).
        Past the host's memory (three tiers), with no `prefetch` asked, it orders the host tier's eviction
        instead (`assembly.eviction_predictor`: where its report finds its next-use head reading less).
    snapshot: a folder saved by `Engine.save_snapshot` to warm-start from.
    prefetch: "none", "profile", "next-gate", "predictor" or "oracle" (see `prefetch/policies.py`); default:
        "predictor" with a predictor, else "none".
    dtype: "auto" (float32 on the CPU backend, else the checkpoint's), "model", or a dtype name.
    direct_io: read experts past the OS page cache (O_DIRECT, F_NOCACHE): True, False, or "auto" (on when
        the model's files are larger than the memory available: their pages would push out the cache).
    read_threads: expert reads in flight at once (demand and prefetch); None: 4 for experts of 1 MiB or
        more (SSDs read faster with a few in flight), 1 for smaller ones.
    packed: read experts from packed rows (`od-moe pack`, one request per expert): "auto" (where the model
        folder has them), True (required), False, or the path of a packed file.
    two_tier: every expert in host memory, read in place by the device on a miss, `capacity` experts per
        layer in device slots, no host sync per layer (`two_tier/two_tier_runtime.py`): "auto" (on CUDA where
        host memory holds the experts, no prediction or skip mode asked), True, False, or "lru" (slots kept by
        the device: `two_tier/kept_rows.py`); then capacity may be 0. `Engine.mode` tells the path,
        `Engine.mode_reason` why.
    ranks: "auto" splits the decoder layers over the `mlx.launch` processes (`distributed/rank_split.py`:
        each caches its own layers' experts, in this budget); None: one process; or an mx.distributed.Group.
    device_memory, context_tokens, sequences: on a GPU with memory of its own (CUDA), its budget (default 90%
        of the card's free memory), which holds the slots beside the rest and a KV cache of `context_tokens`
        for each of `sequences` (`memory/capacity.py`); the memory budget is then the host's.
        `capacity_choice`.
    """
    check_policies(miss_policy, eviction)
    path = resolve_model_path(model)
    backend.reset_peak_memory()  # so load_peak_bytes measures this load
    store = open_store(path, packed, direct_io)
    identity = model_identity(path, store)
    asked_of_ranks = dict(
        capacity=capacity, memory_budget=memory_budget, miss_policy=miss_policy, dtype=dtype
    )
    group = rank_split.join(ranks, dict(asked_of_ranks, model=identity), predictor)
    mlx_model, tokenizer = open_model(path, dtype)
    stage = group and rank_split.split(mlx_model, group, find_moe_blocks(mlx_model))
    blocks = offloadable_blocks(mlx_model, path)
    kv = kv_nbytes_per_token(mlx_model)  # a lazy run, before od-moe changes the model
    device = device_plan(device_memory, context_tokens, sequences, max_positions(path))
    asked = dict(two_tier=two_tier, capacity=capacity, memory_budget=memory_budget, miss_policy=miss_policy)
    place = place_experts(mlx_model, blocks, device, kv, prefetch=prefetch, predictor=predictor, **asked)
    own_rows = not place.mode.tiered  # two tiers hold the slots in their stacks' last rows
    caches = [cache_for(block, i, store, place.slots, eviction, own_rows) for i, block in enumerate(blocks)]
    threads = read_threads_of(read_threads, caches)
    settings = settings_for_path(place.mode, path_settings, miss_policy, threads, place.host_experts)
    why = place.why
    if place.predictor_evicts and place.host_experts is not None:
        # three tiers run no prefetch policy: the predictor may order the host tier's eviction instead
        resident = (place.slots + place.host_experts) / caches[0].num_experts
        chosen, said = eviction_predictor(predictor, identity, resident)
        why = f"{why}; {said}"
        if chosen is not None and isinstance(settings, TwoTierSettings) and settings.host_next_use is None:
            settings = replace(settings, host_next_use=chosen)
        predictor, prefetch = None, "none"
    runtime = build_runtime(store, blocks, caches, place.mode, why, settings, across_ranks=bool(stage))
    if stage:
        rank_split.wrap_seams(mlx_model, stage)
    mx.eval(mlx_model.parameters())  # non-expert weights and the empty slots; experts stay on disk
    modules, top_k = [b.block for b in blocks], top_k_of(blocks[0].block)
    engine = Engine(
        mlx_model,
        tokenizer,
        path,
        runtime,
        modules,
        identity,
        top_k,
        place.non_expert_nbytes,
        stage=stage or None,
        capacity_choice=place.choice,
        device_budget=device,
        kv_nbytes_per_token=kv,
    )
    for line in filter(None, (why if two_tier != "auto" or place.mode.tiered else None, place.choice)):
        say(line)
    engine.start(predictor, prefetch, snapshot)
    return engine


def _read_every_expert(engine: Engine):
    nbytes = sum(c.layout.expert_nbytes * c.num_experts for c in engine.caches)
    with byte_progress("reading experts", nbytes) as bar:
        for cache in engine.caches:
            engine.runtime.load(cache, np.arange(cache.num_experts))
            bar.update(cache.layout.expert_nbytes * cache.num_experts)


def model_layouts(model=None, packed=False) -> tuple[ExpertStore, list[BlockLayout]]:
    """The store and MoE block layouts of a model folder (None: the embedded model), for `od-moe pack`
    (and the bench's read measurement, which reads as the engine would: `packed` as `load` takes it)."""
    engine = load(model, capacity=1, prefetch="none", packed=packed)  # the layouts; no expert is read
    engine.close()
    return engine.runtime.store, [c.layout for c in engine.caches]
