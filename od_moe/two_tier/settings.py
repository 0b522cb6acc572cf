"""How the two-tier path runs (`TwoTierSettings`, with its groups `AdmissionSettings`, `KeptRowsSettings` and
`ForecastSettings`), and each setting's default with why it is that: given to `two_tier.build` once, never
written into its runtime afterwards.

`engine.load` fills in the kind of slots it chose (`two_tier="lru"`: kept by the device) and why; benchmarks,
the lab and tests pass the rest as `load(path_settings=TwoTierSettings(...))`. A setting `None` where the
path decides (from the experts' size, or from where MLX runs). Not here: the runtime these settle
(`two_tier_runtime.py`), choosing the path (`assembly.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# positions decoded between admissions (a prompt's prefill is admitted at once), and at least ADMIT_PASSES
# passes. Even with slots filled by kernels and tables written into host rings, a pass that fills costs
# more than another, and admitting more often buys hit rate but no speed that holds, so admissions stay
# rare. A batch's pass brings the routing of all its sequences, so admission counts positions: counting
# passes, a batch would admit too rarely and miss more; admitting every few passes decoded slower
# (`docs/GPU.md`, "Slots and admission")
ADMIT_EVERY, ADMIT_PASSES = 64, 8
# Past the host's memory a miss outside the slots and host rows is a disk read, and a host tier of a few rows
# a layer keeps too few of them for recency to make up for slots admitted rarely: admitting every 8
# positions read 14-21% fewer bytes from disk with host tiers of 8 (the bundled model at 16 + 8, the
# Qwen3-30B-A3B shape's first 8 layers at 32 + 8; none fewer at 16 + 16), where a fill costs a few
# milliseconds against tens for the reads (`docs/GPU.md`, "Admission past the host's memory")
ADMIT_EVERY_PAST_HOST = 8
HALF_LIFE = 32.0  # forward passes after which a routing count weighs half
MARGIN = 2.0  # decayed uses a newcomer must have over the expert it replaces (a copy costs ~3 reads)
MAX_SWAPS = 8  # replacements per layer per admission (filling free slots is not limited)

BLOCKS = 1  # per (expert, array): a copy's loads wait on PCIe, and blocks that wait hold SMs the layers need
# Blocks per array for a layer's own misses, spread over its candidates (16 each at top-8): those copies
# are on the pass's path, with no layer to share the SMs with, and more loads in flight move them sooner,
# up to a plateau past 16 blocks an (expert, array) (`docs/GPU.md`, "Device-kept rows").
DEMAND_BLOCKS = 128

FORECASTS = ("none", "next-gate", "shadow", "custom")
DISK_PREFETCH = ("none", "routed")
DISK_RERUNS = ("flagged", "exact")
FLAGGED_RUNS = 3  # runs of a decode pass without waiting for routing, before one that waits at each layer
DISK_FLOOR = 0.7  # `ForecastSettings.floor`
# reads in flight from disk into the host tier: an NVMe disk serves several at once faster than one
# (`od_moe.bench.roofline.disk_rate` measures the best count on a machine)
DISK_THREADS = 8
# at most a request of an expert's read past the host's memory: an expert of a few MB is several requests
# in flight at once, where one an expert would keep one or two in flight for a layer's few experts
DISK_SPAN = 512 * 1024


@dataclass(frozen=True)
class AdmissionSettings:
    """Slots admitted by routing counts (`admission.py`): how often, which experts earn one, and how they
    are copied in. Off where the device keeps the slots (`TwoTierSettings.kept_by_device`)."""

    enabled: bool = True  # fill slots between passes (off: they stay as loaded, seeded or restored)
    every: int | None = None  # positions between admissions; None: the tiers' own (`cadence`)
    half_life: float = HALF_LIFE
    margin: float = MARGIN
    max_swaps: int = MAX_SWAPS
    # fills as CUDA kernels with no wait (`slot_fill.py`); False: MLX writes after a wait; None: where MLX
    # runs on CUDA (elsewhere True needs a stand-in for the kernel, as the tests give)
    by_kernel: bool | None = None

    def cadence(self, past_host_memory: bool) -> int:
        """Positions between admissions: `every` where given, else `ADMIT_EVERY_PAST_HOST` past the host's
        memory (a bounded host tier, the rest on disk) and `ADMIT_EVERY` where the host holds every expert."""
        if self.every is not None:
            return self.every
        return ADMIT_EVERY_PAST_HOST if past_host_memory else ADMIT_EVERY


@dataclass(frozen=True)
class KeptRowsSettings:
    """Rows the device keeps after a layer's slots (`kept_rows.py`), least recently used (or by decayed
    routing counts), filled by the layer's own misses and by forecasts (`ForecastSettings`). With
    `TwoTierSettings.kept_by_device` the slots themselves are such rows."""

    rows: int = 0  # per layer, past the slots
    predicted: int | None = None  # experts a forecast copies ahead into a layer's rows; None: one per row
    demand: bool = True  # a layer's misses copied into its rows before it reads them
    copy: bool = True  # False: decide and count, copy nothing (profiling the decision alone)
    # rows by decayed routing counts (each pass's counts times `decay`, plus one where routed); a miss
    # takes a row only where its count beats the row's; None: least recently used
    decay: float | None = None
    blocks: int = BLOCKS  # thread blocks per (expert, array) of a forecast's copy
    demand_blocks: int = DEMAND_BLOCKS  # thread blocks per array of a layer's own copies, over its candidates
    # decided by the CUDA kernel; False: on the host, in numpy; None: where MLX runs on CUDA (elsewhere True
    # needs a stand-in for `mx.fast.cuda_kernel`, as the tests and the lab give)
    by_kernel: bool | None = None


@dataclass(frozen=True)
class ForecastSettings:
    """Forecasts of a later layer's routing from an earlier layer's hidden state (`forecast.py`), whose top
    experts decode passes copy into that layer's device-kept rows ahead of it: the target's router
    applied to the source's state ("next-gate"), the shadow network (`predictor`, "shadow"), or one of
    the caller's own (`custom(source layer, x)` -> [(target layer, scores (n, E))], "custom": the lab's)."""

    kind: str = "none"  # one of `FORECASTS`
    distance: int = 1  # layers ahead
    # past the host's memory, a forecast's expert is read from disk ahead only where top-k x its probability
    # is at least this (0: its top k all). Replayed on the bundled model's routing (16 + 8 and 16 + 16, the
    # shadow network 1-2 layers ahead, next-use eviction), reads ahead below 0.7 took rows and disk time from
    # experts needed sooner: they hid less of the stall (docs/GPU.md, "Replayed against a clock")
    floor: float = DISK_FLOOR
    predictor: Any = field(default=None, compare=False)  # the shadow network (`predictor/model.py`)
    custom: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class TwoTierSettings:
    """The two-tier path's settings."""

    kept_by_device: bool = False  # the slots are rows the device keeps (`kept_rows.py`), not admitted
    mode_reason: str = ""  # why two tiers run (`Runtime.mode_reason`)
    # a pass of this many positions or more is staged (`staged_passes.py`); None: from the experts' size
    stage_positions: int | None = None
    # a decoded token's MoE blocks each one compiled call where that is exact (`layer_step.CompiledBlock`);
    # False: every block op by op, its switch compiled (as where a block compiles otherwise)
    compile_blocks: bool = True
    admission: AdmissionSettings = AdmissionSettings()
    kept_rows: KeptRowsSettings = KeptRowsSettings()
    forecast: ForecastSettings = ForecastSettings()
    # past the host's memory (`host_tier.py`): experts a layer in host memory, the rest on disk; None: all
    host_experts: int | None = None
    disk_threads: int = DISK_THREADS  # reader threads reading experts from disk into the host tier
    # an expert's read in requests of at most this many bytes at once (`ExpertStore.spans`); 0: one thread
    # an expert, one request a part
    disk_span: int = DISK_SPAN
    # past the host's memory: the shadow network (`predictor/model.py`) whose next-use head orders the host
    # tier's eviction, the expert estimated to be needed last first (`host_eviction.py`); None: least
    # recently used first
    host_next_use: Any = field(default=None, compare=False)
    # what a decode pass that met an expert on disk reads ahead before it runs again (`disk_passes.py`):
    # "routed": the experts it routed to past its first miss; "none": each layer reads its own (demand)
    disk_prefetch: str = "routed"
    # how a pass that met an expert on disk runs again: "exact" (from its first miss each layer learns its
    # routing and reads what it needs first) or "flagged" (once its reads landed, no layer waiting for its
    # routing; exact, as the last of `FLAGGED_RUNS` runs, where it missed again). With the bundled model's
    # trained routing flagged second runs missed again, and ran slower (docs/GPU.md, "Past the host's
    # memory: three tiers")
    disk_rerun: str = "exact"
    # a flagged pass reads each layer's count of absent lanes this many layers after it, stopping there
    # where it is not 0 (the rest of the pass would be computed wrong); 0: counts read with the logits only
    flag_lag: int = 2
    # a flagged pass stops at the first layer whose count shows absent lanes (read `flag_lag` layers on);
    # False: it runs to its end, each such layer's experts on disk read from then on (the first's known,
    # later ones a forecast: their inputs were wrong), so the run again finds them landed or in flight
    flag_stop: bool = True
    # a flagged decode pass's first this many MoE layers learn their routing (a host sync each) and read what
    # is on disk before they compute, as a pass run again exactly does: a miss there would run the whole
    # pass again, and a model's first layers, routed from little more than the token, miss the most
    exact_layers: int = 0
