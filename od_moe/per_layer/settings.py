"""How the per-layer path runs (`PerLayerSettings`): given to `per_layer.build` once, never written into its
runtime afterwards.

`engine.load` fills in what its own arguments say (the miss policy, read threads, a rank of a pipeline);
benchmarks and tests pass the rest as `load(path_settings=PerLayerSettings(...))`; the runtime settles every
None for its backend and experts (`PerLayerRuntime.settings`). Not here: the runtime (`per_layer_runtime.py`),
or what to prefetch and how (`prefetch/`, `PrefetchSettings`).
"""

from dataclasses import dataclass

from .reader import READ_THREADS


@dataclass(frozen=True)
class PerLayerSettings:
    """The per-layer path's settings; None: the backend's default, as each field says."""

    miss_policy: str = "load"  # "load" (exact) or "skip" (missing experts scaled out: approximate)
    read_threads: int = READ_THREADS  # expert reads in flight at once (demand and prefetch)
    # decode passes with one host sync (`optimistic.py`); None: where a sync stalls the device. Off on a
    # rank of a pipeline: a pass run again would send and receive again
    optimistic: bool | None = None
    # the share of decode tokens that missed somewhere, as assumed before the first: optimistic passes run
    # while the moving average is below `optimistic.OPTIMISTIC_BELOW` (0: from the first decode pass)
    assumed_token_miss_rate: float = 1.0
    # a decode layer that misses computes its resident experts while the missing ones are read; None: on
    # the CPU backend for experts of `reader.SMALL_EXPERT_BYTES` or more
    split_on_miss: bool | None = None
    launch_early: bool = True  # a layer the host synced at starts computing at once (`Route.launch`)
    # installs copy read bytes into the slots (else MLX writes from arrays the readers made); None: where
    # MLX arrays are host memory
    copy_installs: bool | None = None
    mode_reason: str = ""  # why the per-layer path runs (`Runtime.mode_reason`)
