"""The ledger: every count od-moe reports, kept in one place and read by everything that reports.

`engine.stats()`, the server's /health and /metrics, `od-moe generate --stats` and the benchmarks all
read a `Ledger` through `summarize()`. Each counter is incremented at exactly one call site (the
runtime for the generation thread's work, the reader for its own), so no figure is re-added anywhere.
The ledger is live: it changes as layers run, and any thread may read a snapshot of it while the
generation thread writes (numpy copies under the GIL; figures may lag by one layer, never go back).

Per phase (prefill, decode) and MoE layer (`LAYER_FIELDS`):
- lookups, hits: the routed experts of the layer, and those already resident, when it ran: one lookup per
  (position, routed expert), so per sequence in a batch (the demand hit rate of DESIGN.md);
- the same per pass: `experts`, `expert_hits`, the distinct experts a pass of the layer routed to (a
  batch's union, looked up once for all its sequences), and those resident; counted where the routing is
  read (`routings_read`: the layer passes counted): on the host, or on the device for the two-tier mode's
  staged passes (`two_tier/staged_passes.py`); not where nothing reads it (every expert resident and nothing
  watching, the two-tier mode's passes of one position): a host sync would cost more than the figure is worth
  there;
- reads on the generation thread (demand misses, profile seeding, snapshots): experts, bytes, seconds;
- prefetch reads taken from the reader (installed or not): experts and bytes; time spent waiting for
  late ones (`wait_s`); installs of both kinds and their seconds; evictions;
- prefetch outcome: useful (used before eviction), wasted (evicted unused, or not installable), late;
- two-tier mode's staged passes (`two_tier/staged_passes.py`): `staged_misses`, their lanes whose expert was
  in no device row (among the misses, but each such expert crossed PCIe once a pass: `experts` -
  `expert_hits`).
- past the host's memory (`two_tier/host_tier.py`): `disk_lanes`, lanes whose expert was on disk when its
  layer learned its routing (read before it computed); `reruns`, decode passes run again from this layer,
  their first with an expert on disk (`stopped_passes` of them stopped a few layers past it, not run to
  the end); every read from disk is in `experts_read` and `bytes_read` (its
  seconds on a reader thread in `disk_read_s`; the pass's wait for reads in `wait_s`), `prefetch_reads`
  those read ahead of need, whose outcome is counted as the per-layer path's prefetch is. A lane in
  neither a device slot (`hits`) nor on disk was read in place from the host tier (`tier_figures`).
Per phase: passes of the model, and positions they ran (a prefill chunk's prompt positions; a decode
pass one per sequence it decodes, so a batch of 8 runs 8). In all: forward passes, and tokens generated
(given to the caller). mlx-lm computes one token ahead of the
one it yields, so N generated tokens take N + 1 decode passes: the extra pass reads experts too, and its
reads are booked like any other's. The reader's own counters (`READER_FIELDS`): reads issued,
completed and their seconds, requests dropped, and the generation thread's time spent on prefetch work
other than installs (`busy_s`: predicting, queueing, choosing what to install, the policy's bookkeeping).
Drafting (`generation/drafts.py`): `verify_passes`, the passes that verified drafts; `drafted`, the draft
tokens they verified; `accepted`, the generated tokens that came from a draft (mlx-lm's `from_draft`);
`found`, prompt lookup's drafts and accepted tokens by where they were found (`FOUND_IN`). While `verifying`
(`book_verifying`, once a drafted generation's prompt is in), every count booked as prefill is booked as
decode: a verify pass runs the last token and its k drafts, k + 1 positions as a prompt's pass does (and the
runtimes run it so), but it decodes. So with drafting a decode pass gives 1 to k + 1 tokens, its positions
count every draft verified, and no pass runs ahead of the tokens given.
Not here: what is done with the figures (the governor decides, the report prints).
"""

import numpy as np

PHASES = ("prefill", "decode")
LAYER_FIELDS = (
    "lookups",
    "hits",
    "experts",
    "expert_hits",
    "routings_read",
    "experts_read",
    "bytes_read",
    "read_s",
    "prefetch_taken",
    "prefetch_bytes",
    "wait_s",
    "installed",
    "install_s",
    "prefetch_installed",
    "prefetch_install_s",
    "evictions",
    "prefetch_useful",
    "prefetch_wasted",
    "prefetch_late",
    "staged_misses",
    "disk_lanes",
    "reruns",
    "prefetch_reads",
    "disk_read_s",
    "stopped_passes",
)
READER_FIELDS = ("issued", "completed", "reader_s", "dropped", "busy_s")
FOUND_IN = ("prompt", "output")  # where prompt lookup found a draft: in the prompt, or in the answer so far
_FIELD = {name: i for i, name in enumerate(LAYER_FIELDS)}
_PHASE = {name: i for i, name in enumerate(PHASES)}
_LOOKUPS, _HITS = _FIELD["lookups"], _FIELD["hits"]
_EXPERTS, _EXPERT_HITS, _ROUTINGS = _FIELD["experts"], _FIELD["expert_hits"], _FIELD["routings_read"]


class Ledger:
    """Counts of one engine since the last `reset()`."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.verifying = False  # passes verify drafts: booked as decode (the module docstring)
        self.reset()

    def reset(self):
        self.layers = np.zeros((len(PHASES), self.num_layers, len(LAYER_FIELDS)))
        self.positions = dict.fromkeys(PHASES, 0)
        self.passes = dict.fromkeys(PHASES, 0)
        self.forwards = 0
        self.generated = 0
        self.verify_passes = self.drafted = self.accepted = 0
        self.found = {s: {"drafted": 0, "accepted": 0} for s in FOUND_IN}  # prompt lookup's, by source
        self.reader = dict.fromkeys(READER_FIELDS, 0)

    def count_reader(self, **counts: float):
        """Add to the reader threads' counts (`READER_FIELDS`: issued, completed, dropped, seconds busy)."""
        for field, value in counts.items():
            self.reader[field] += value

    def set_reader_issued(self, issued: int):
        """Reads issued and not yet landed, as the reader counts them after a reset
        (`Loader.reset_counts`)."""
        self.reader["issued"] = issued

    def book_verifying(self, on: bool):
        """Book every pass as decode (on: passes verify drafts, the module docstring) or by its shape."""
        self.verifying = on

    def add(self, phase: str, layer: int, **counts):
        """Add `counts` (names from `LAYER_FIELDS`) to one layer in one phase."""
        row = self.layers[_PHASE["decode" if self.verifying else phase], layer]
        for name, value in counts.items():
            row[_FIELD[name]] += value

    def count_lookups(
        self, phase: str, layer: int, lookups: int, hits: int, experts: int = 0, expert_hits: int = 0
    ):
        """`add(phase, layer, lookups=..., hits=...)`, without the keyword loop: it runs at every layer.
        `experts`, `expert_hits`: the pass's distinct routed experts and those resident, where the routing
        was read (a layer pass routes to one at least)."""
        row = self.layers[_PHASE["decode" if self.verifying else phase], layer]
        row[_LOOKUPS] += lookups
        row[_HITS] += hits
        if experts:
            row[_EXPERTS] += experts
            row[_EXPERT_HITS] += expert_hits
            row[_ROUTINGS] += 1

    def count_forward(self, phase: str, positions: int):
        phase = "decode" if self.verifying else phase
        self.forwards += 1
        self.passes[phase] += 1
        self.positions[phase] += positions

    def count_generated(self, tokens: int, from_draft: bool = False):
        """Tokens given to the caller (not the passes that computed them); `from_draft`: they were a draft's,
        accepted."""
        self.generated += tokens
        self.accepted += tokens if from_draft else 0

    def count_verify(self, drafted: int):
        """A pass that verifies `drafted` draft tokens (booked as decode while `verifying`)."""
        self.verify_passes += 1
        self.drafted += drafted

    def count_found(self, drafted: dict, accepted: dict):
        """Prompt lookup's drafts and accepted tokens by where they were found (`FOUND_IN`)."""
        for source in FOUND_IN:
            self.found[source]["drafted"] += drafted[source]
            self.found[source]["accepted"] += accepted[source]

    def total(self, name: str, phase: str | None = None) -> float:
        """One layer field summed over layers, in one phase or (None) in both."""
        rows = self.layers if phase is None else self.layers[_PHASE[phase]]
        return float(rows[..., _FIELD[name]].sum())

    def snapshot(self) -> "Ledger":
        """A copy that no longer changes (safe to read from any thread)."""
        copy = Ledger.__new__(Ledger)
        copy._copy_of(self)
        return copy

    def _copy_of(self, other: "Ledger"):
        """Become a copy of `other`'s counts (`snapshot`)."""
        self.num_layers = other.num_layers
        self.layers = other.layers.copy()
        self.positions, self.forwards, self.reader = dict(other.positions), other.forwards, dict(other.reader)
        self.generated, self.passes = other.generated, dict(other.passes)
        self.verifying, self.verify_passes = other.verifying, other.verify_passes
        self.drafted, self.accepted = other.drafted, other.accepted
        self.found = {s: dict(v) for s, v in other.found.items()}

    def field(self, name: str) -> np.ndarray:
        """(phases, layers) values of one field."""
        return self.layers[:, :, _FIELD[name]]


def _rate(hits, lookups) -> float | None:
    return hits / lookups if lookups else None


def _phase_counts(lookups: float, hits: float) -> dict:
    lookups, hits = int(lookups), int(hits)
    return {"lookups": lookups, "hits": hits, "misses": lookups - hits, "hit_rate": _rate(hits, lookups)}


def _io(led: Ledger, phase_index, layer_index) -> dict:
    """Reads, stall and install figures of a slice of the ledger (summed over what it selects)."""

    def f(name):
        return led.field(name)[phase_index, layer_index].sum()

    return {
        # read (demand, prefetch taken, and scratch rows of a layer whose routed experts overflow its
        # slots) and loaded (installed into slots) differ: not every read expert is installed
        "experts_read": int(f("experts_read") + f("prefetch_taken")),
        "experts_loaded": int(f("installed") + f("prefetch_installed")),
        "bytes_read": int(f("bytes_read") + f("prefetch_bytes")),
        "stall_s": float(f("read_s") + f("wait_s")),
        "install_s": float(f("install_s") + f("prefetch_install_s")),
        "evictions": int(f("evictions")),
    }


def layer_rows(led: Ledger, caches) -> list[dict]:
    """Per MoE layer: demand lookups and hits (in all, and per phase), reads, stall, installs and the
    cache's state."""
    rows = []
    everywhere = slice(None)
    for i, cache in enumerate(caches):
        phases = {
            p: _phase_counts(led.field("lookups")[n, i], led.field("hits")[n, i])
            for n, p in enumerate(PHASES)
        }
        both = _phase_counts(
            sum(v["lookups"] for v in phases.values()), sum(v["hits"] for v in phases.values())
        )
        rows.append(
            {
                "layer": i,
                "module": cache.layout.module_path,
                **both,
                **phases,
                **_io(led, everywhere, i),
                "resident": cache.resident_count,
                "pinned": cache.pinned_count,
                "capacity": cache.capacity,
            }
        )
    return rows


def totals(rows: list[dict]) -> dict:
    """The per-layer rows added up."""
    keys: tuple[str, ...] = ("lookups", "hits", "misses", "experts_read", "experts_loaded", "bytes_read")
    keys += ("stall_s", "install_s", "evictions")
    out = {k: sum(r[k] for r in rows) for k in keys + ("resident", "pinned", "capacity")}
    out["hit_rate"] = _rate(out["hits"], out["lookups"])
    for phase in PHASES:
        out[phase] = _phase_counts(
            sum(r[phase]["lookups"] for r in rows), sum(r[phase]["hits"] for r in rows)
        )
    return out


def per_pass(led: Ledger, phase: str = "decode") -> dict:
    """A phase's lookups per sequence and per pass, each MoE layer's average: the sequences a pass ran
    (decode: the batch), their lookups (sequences x top-k), the distinct experts they routed to (the
    batch's union, looked up and read once for all) and the share of those resident, the experts read;
    per sequence, the hit rate and the experts read. None where nothing was counted (`experts`: where no
    routing was read)."""
    layers, n = led.num_layers, _PHASE[phase]
    passes, positions = led.passes[phase], led.positions[phase]

    def f(name):
        return float(led.field(name)[n].sum())

    lookups, read, routings = f("lookups"), f("experts_read") + f("prefetch_taken"), f("routings_read")
    experts = f("experts")
    return {
        "passes": passes,
        "positions": positions,
        "experts": int(experts),
        "expert_hits": int(f("expert_hits")),
        "routings_read": int(routings),
        "sequences_per_pass": positions / passes if passes else None,
        "lookups_per_layer_pass": lookups / (passes * layers) if passes and layers else None,
        "experts_per_layer_pass": experts / routings if routings else None,
        "pass_hit_rate": _rate(f("expert_hits"), experts),
        "experts_read_per_layer_pass": read / (passes * layers) if passes and layers else None,
        "sequence_hit_rate": _rate(f("hits"), lookups),
        "experts_read_per_sequence": read / positions if positions else None,
    }


def tier_figures(led: Ledger, tiers: dict[str, int], host_eviction: str | None = None) -> dict:
    """Where routed lanes found their experts and what the disk did: experts a layer each tier holds at
    most (`tiers`, the path's), lanes by tier (device slots, read in place from host memory, on disk when
    the layer learned its routing), and the disk's reads, bytes, seconds on the reader threads, the
    passes' wait for them, passes run again, and reads ahead of need with their outcome; past the host's
    memory, which host row goes first (`host_eviction`: "recency" or "next-use")."""
    lookups, hits, disk_lanes = (int(led.total(name)) for name in ("lookups", "hits", "disk_lanes"))
    on_disk = disk_lanes if tiers.get("host") else lookups - hits  # the per-layer path reads every miss
    read_s = float(led.total("disk_read_s") + led.total("read_s"))
    return {
        "experts_per_layer": dict(tiers),
        "host_eviction": host_eviction,
        "lanes": {"device": hits, "host": lookups - hits - on_disk, "disk": on_disk},
        "disk": {
            "experts_read": int(led.total("experts_read") + led.total("prefetch_taken")),
            "bytes_read": int(led.total("bytes_read") + led.total("prefetch_bytes")),
            "read_s": read_s,
            "wait_s": float(led.total("wait_s")),
            "reruns": int(led.total("reruns")),
            "stopped_passes": int(led.total("stopped_passes")),
            "prefetch_reads": int(led.total("prefetch_reads")),
            "prefetch_useful": int(led.total("prefetch_useful")),
            "prefetch_wasted": int(led.total("prefetch_wasted")),
            "prefetch_late": int(led.total("prefetch_late")),
        },
    }


def io_by_phase(led: Ledger) -> dict[str, dict]:
    """Bytes read, experts installed, stall and install seconds by the phase of the pass that caused them."""
    everywhere = slice(None)
    keys = ("bytes_read", "experts_read", "experts_loaded", "stall_s", "install_s")
    return {p: {k: v for k, v in _io(led, n, everywhere).items() if k in keys} for n, p in enumerate(PHASES)}


def prefetch_counts(led: Ledger, unused_installed: int) -> dict:
    """What prefetch did: issued = useful + wasted + in flight (being read, read and not taken, or
    installed and not used yet)."""
    useful, wasted = int(led.total("prefetch_useful")), int(led.total("prefetch_wasted"))
    issued, taken = int(led.reader["issued"]), int(led.total("prefetch_taken"))
    installed = int(led.total("prefetch_installed"))
    return {
        "issued": issued,
        "useful": useful,
        "late": int(led.total("prefetch_late")),
        "wasted": wasted,
        "in_flight": issued - taken + unused_installed,
        "dropped": int(led.reader["dropped"]),
        "installed": installed,
        "precision": _rate(useful, useful + wasted),
        "bytes_read": int(led.total("prefetch_bytes")),
        "read_s": float(led.reader["reader_s"]),
        "wait_s": float(led.total("wait_s")),
    }


def draft_counts(led: Ledger) -> dict:
    """Drafting's figures: verify passes, the draft tokens they verified, those accepted (given to the caller)
    and their share (None without drafts)."""
    return {
        "verify_passes": led.verify_passes,
        "drafted": led.drafted,
        "accepted": led.accepted,
        "acceptance_rate": _rate(led.accepted, led.drafted),
        "found_in": {s: dict(v) for s, v in led.found.items()},
    }


def experts_moved(led: Ledger, two_tier: bool, device_lru: bool = False, phase: str | None = "decode") -> int:
    """Experts that `phase`'s passes (None: every pass) brought to where they compute. The per-layer path:
    experts read from storage, on demand and by prefetch (each into a slot or a scratch row). Two-tier mode:
    lanes that read their expert in place (misses), the distinct experts staged passes copied from host rows
    (once for all their lanes: `two_tier/staged_passes.py`), and copies into slots; with device-kept rows
    (`two_tier="lru"`) a miss is copied into a row and read there, so the copies, and the experts a staged
    pass found in no row."""
    if not two_tier:
        return int(led.total("experts_read", phase) + led.total("prefetch_taken", phase))
    copies = led.total("installed", phase) + led.total("prefetch_installed", phase)
    not_held = led.total("experts", phase) - led.total("expert_hits", phase)  # staged passes' distinct
    if device_lru:
        return int(copies + not_held)
    misses = led.total("lookups", phase) - led.total("hits", phase)
    return int(misses + not_held - led.total("staged_misses", phase) + copies)


def decode_figures(led: Ledger, two_tier: bool, device_lru: bool = False) -> dict:
    """Drafting's counts (`draft_counts`), and the experts decode passes moved (`experts_moved`) per
    generated token (None before any)."""
    moved = experts_moved(led, two_tier, device_lru)
    return {
        "drafts": draft_counts(led),
        "decode_experts_moved": moved,
        "experts_per_token": moved / led.generated if led.generated else None,
        "moved_as": "read in place plus copied" if two_tier else "read",
    }
