"""The prefetch governor: how many experts to prefetch per layer, and whether prefetch pays at all.

It decides from the ledger, between tokens (`end_token`), with its settings in one dataclass:
- Precision: every `window` decode tokens the precision of that window is checked; below
  `MIN_PRECISION` the experts asked per layer are halved (down to none), above `RECOVER_PRECISION`
  they grow back.
- Baseline (timed, off by default): after a reset, the first `baseline_tokens` decode tokens run with
  prefetch paused, so that what demand reads cost alone is known before prefetch is first judged.
- Gain (timed): after `first_check` tokens with prefetch on (a token later per token of unknown time,
  as the first after a reset, or of a one-off cost such as kernels compiling on first use), the demand
  reads its useful prefetches saved are weighed against what it cost the generation thread (predicting,
  queueing, its bookkeeping, installing). A saved read is priced at what a demand read costs the
  generation thread per expert (batched per layer, so less than one read's latency on a disk that likes a
  deep queue) in decode with prefetch paused (the baseline and later pauses), or in that stretch if that
  is less; without such reads, in that stretch, else in decode so far, else at the reader's mean read
  time; plus the mean install time. Demand reads beside prefetch reads wait for the disk, the CPU and
  the GIL they share, and prefill's read more at once: priced by either, prefetch seemed to save more
  than a whole token without it took (docs/GPU.md, "The per-layer path on CUDA"). If the saving is
  smaller, with `MIN_GAIN` of the
  token time as margin (reads from the page cache of a small model), it pauses; while paused, a demand
  stall worth twice that cost brings it back.
- Cost probe (timed): after `first_probe` tokens, then every `probe_every`, it switches prefetch off for
  `probe_tokens` tokens; if tokens are faster without it (by `COST_MARGIN`), it pauses for
  `pause_tokens`.
- Read-bound (timed): where the generation thread spent at least `READ_BOUND_ENTER` of the last
  `read_window` tokens waiting for expert reads, the read path is the bottleneck and every speculative
  read delays a needed one: only predictions scored `read_bound_score` or more are read (`min_score`),
  until that share falls below `READ_BOUND_LEAVE`.
`timed_checks=False` keeps only the precision check (deterministic runs and tests).
Not here: reading (`reader.py`) or predicting (`policies.py`).
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..accounting.ledger import Ledger

MIN_PRECISION, RECOVER_PRECISION = 0.25, 0.5
COST_MARGIN = 0.03  # the cost probe pauses prefetch when tokens run this much faster without it
MIN_GAIN = 0.02  # of the token time: what prefetch must save beyond its cost to stay on
# a measuring token this many times slower than another of its window carries a one-off (the predictor's
# kernels compiling on first use take orders of magnitude longer than a token: docs/GPU.md, "The per-layer
# path on CUDA"): the gain check waits for a window without it
ONE_OFF = 10
READ_BOUND_ENTER, READ_BOUND_LEAVE = 0.5, 0.25  # of the token time spent waiting for reads
MARKS_KEPT = 64


@dataclass(frozen=True)
class PrefetchSettings:
    """How prefetch runs (`Engine.configure_prefetch(settings=...)`): given once, never written into the
    governor or the runtime afterwards."""

    experts_per_layer: int | None = None  # most experts asked per layer ahead; None: the model's top-k
    window: int = 16  # decode tokens per precision check
    timed_checks: bool = True  # the baseline, the gain check, the cost probe and the read-bound check
    # decode tokens after a reset with prefetch paused (with `timed_checks`), to price saved reads by demand
    # reads alone from the first gain check on. Off by default: paused tokens helped the predictor in some
    # runs and cost it in others, and slowed the oracle (docs/GPU.md, "The per-layer path on CUDA")
    baseline_tokens: int = 0
    first_check: int = 2
    first_probe: int = 48
    probe_every: int = 48
    probe_tokens: int = 8
    pause_tokens: int = 192
    synchronous: bool = False  # every read lands before the next layer runs: deterministic figures
    # no speculative read of an expert whose score (the probability that it is routed, discounted with
    # distance) is lower: on the bundled model's bench prompts at 25% resident, 0.4 read 22.3 experts per
    # token with a decode hit rate of 0.850 where 0 read 27.7 (0.896) and on-demand LRU 22.3 (0.651)
    min_score: float = 0.4
    # where reads are the bottleneck (see the module docstring): the floor then; on the widened copy at 25%
    # cold on the CPU, 0.9 read 23.8 experts per token (hit 0.684) where 0.4 read 26.9 (0.797) and
    # on-demand LRU 27.0 (0.578)
    read_bound_score: float = 0.9
    read_window: int = 4  # decode tokens over which the read-bound share is measured
    # the read-bound verdict after a reset, before the read-bound check (with `timed_checks`) first decides
    read_bound_at_start: bool = False
    # eviction and reads follow the policy's estimates of when each expert is needed next, where it makes
    # them (the oracle; the predictor's next-use head); off, the cache's own eviction rule decides and every
    # prediction the governor allows is read (the head still runs: a comparison, not a saving)
    next_use_estimates: bool = True


# what the governor reports when prefetch is off (no policy reads ahead)
OFF = {
    "experts_per_layer": 0,
    "mode": "off",
    "cost_probe": None,
    "gain": None,
    "backoffs": 0,
    "backoff_reason": None,
    "read_bound": False,
    "stall_share": None,
}


class _Mark(NamedTuple):  # cumulative counts at the end of a forward pass
    mode: str
    seconds: float | None
    stall_s: float
    useful: float
    reads: float  # the reader's completed reads, and their seconds
    read_s: float
    demand: float  # experts read on the generation thread in decode, and its seconds doing so
    demand_s: float
    quiet: float  # the same in decode with prefetch paused, since the reset
    quiet_s: float
    cost_s: float
    per_install_s: float


def _per_read(first: _Mark, last: _Mark) -> float:
    """What one expert read costs the generation thread: a demand read's per expert in decode with prefetch
    paused (or between the marks, if less); without those, between the marks, else in all of decode, else
    the reader's mean read time between them, else of all its reads."""
    if last.demand > first.demand:
        stretch = (last.demand_s - first.demand_s) / (last.demand - first.demand)
        return min(stretch, last.quiet_s / last.quiet) if last.quiet else stretch
    if last.quiet:
        return last.quiet_s / last.quiet
    if last.demand:
        return last.demand_s / last.demand
    reads = last.reads - first.reads
    return (last.read_s - first.read_s) / reads if reads else last.read_s / max(last.reads, 1)


class Governor:
    def __init__(self, settings: PrefetchSettings, ledger: Ledger, experts_per_layer: int):
        self.settings, self.ledger = settings, ledger
        self.per_layer_max = experts_per_layer
        self.reset()

    def reset(self) -> None:
        self.per_layer = self.per_layer_max
        self.mode, self._mode_since = "on", 0
        self.probe: dict | None = None  # the cost probe's token times, on and off
        # "gain": little to hide, resumes when the stall grows; "cost": the probe said so; "baseline": the
        # first tokens after a reset
        self._pause_kind: str | None = None
        self.gain: dict | None = None  # the last check of what prefetch hides
        self._gain_checked = False  # this stretch with prefetch on has had its gain check
        self.backoffs = 0
        self.backoff_reason: str | None = None
        self.pause: dict | None = None  # the last pause (gain or cost): at which token, why, when it ends
        # the read-bound check's verdict and its measure
        self.read_bound = self.settings.read_bound_at_start
        self.stall_share: float | None = None
        self.decode_tokens = 0
        self._window_start = (0, 0.0, 0.0)  # (tokens, useful, wasted) at the start of the window
        self._marks: list[_Mark] = []
        self._quiet: tuple[float, float] = (0.0, 0.0)  # demand experts and seconds in decode, prefetch paused
        self._demand = self._demand_totals()  # ...counted from here
        if self.settings.timed_checks and self.settings.baseline_tokens > 0:
            self._set_mode("paused", "baseline")

    @property
    def active(self) -> bool:
        """Whether to predict and read now."""
        return self.per_layer > 0 and self.mode == "on"

    @property
    def measuring(self) -> bool:
        """True while a stretch with prefetch on awaits its gain check (its first `first_check` tokens, or
        more where a token's time was unknown): the policy's compute is then timed apart (one more sync
        per layer)."""
        return self.settings.timed_checks and self.mode == "on" and not self._gain_checked

    @property
    def min_score(self) -> float:
        """The lowest score of a prediction worth a speculative read now."""
        s = self.settings
        return max(s.min_score, s.read_bound_score) if self.read_bound else s.min_score

    def take(self, candidates: int) -> int:
        """How many of a layer's best `candidates` to read (fewer after precision back-offs)."""
        return -(-candidates * self.per_layer // self.per_layer_max)

    def end_token(self, phase: str, seconds: float | None = None):
        """Between tokens (`seconds`: wall time of the pass that ended, None where unknown)."""
        led = self.ledger
        installs = led.total("prefetch_installed")
        mode = self.mode if phase == "decode" else phase
        before, self._demand = self._demand, self._demand_totals()
        if mode == "paused":
            (experts, read_s), (experts_now, read_s_now) = self._quiet, self._demand
            self._quiet = (experts + experts_now - before[0], read_s + read_s_now - before[1])
        self._marks.append(
            _Mark(
                mode,
                seconds,
                led.total("read_s") + led.total("wait_s"),
                led.total("prefetch_useful"),
                led.reader["completed"],
                led.reader["reader_s"],
                *self._demand,
                *self._quiet,
                led.reader["busy_s"] + led.total("prefetch_install_s"),
                led.total("prefetch_install_s") / max(installs, 1),
            )
        )
        del self._marks[:-MARKS_KEPT]
        if phase != "decode":
            return
        self.decode_tokens += 1
        self._check_precision()
        if self.settings.timed_checks:
            self._check_gain()
            self._check_cost()
            self._check_reads()

    def stats(self) -> dict:
        return {
            "experts_per_layer": self.per_layer,
            "mode": self.mode,
            "cost_probe": self.probe,
            "gain": self.gain,
            "backoffs": self.backoffs,
            "backoff_reason": self.backoff_reason,
            "pause": None if self.pause is None else {**self.pause, "still": self.mode == "paused"},
            "read_bound": self.read_bound,
            "stall_share": self.stall_share,
        }

    # -- checks -----------------------------------------------------------------------------------
    def _check_precision(self):
        tokens0, useful0, wasted0 = self._window_start
        if self.decode_tokens - tokens0 < self.settings.window:
            return
        useful, wasted = self.ledger.total("prefetch_useful"), self.ledger.total("prefetch_wasted")
        du, dw = useful - useful0, wasted - wasted0
        self._window_start = (self.decode_tokens, useful, wasted)
        if du + dw == 0:
            return
        precision = du / (du + dw)
        if precision < MIN_PRECISION and self.per_layer > 0:
            self.per_layer //= 2
            self._back_off(
                f"precision {precision:.2f} over the last {self.settings.window} tokens is "
                f"below {MIN_PRECISION}: now {self.per_layer} experts per layer"
            )
        elif precision > RECOVER_PRECISION and self.per_layer < self.per_layer_max:
            self.per_layer = min(self.per_layer_max, max(1, self.per_layer * 2))

    def _gain(self, tokens: int) -> dict | None:
        """Over the last `tokens` tokens, per token in ms: the time prefetch saved the demand path (on: its
        useful prefetches times a read's price, `_per_read`, and the mean install time) or could have
        saved (paused: the demand stall), what it cost the generation thread, and the token time."""
        marks = self._marks[-tokens - 1 :]
        times = [m.seconds for m in marks[1:] if m.mode == self.mode and m.seconds is not None]
        if len(marks) < tokens + 1 or len(times) < tokens:
            return None
        if self.mode == "on" and max(times) > ONE_OFF * min(times):
            return None  # a one-off in the window (see ONE_OFF): wait for a clean one
        first, last = marks[0], marks[-1]
        useful = last.useful - first.useful
        price = _per_read(first, last) + last.per_install_s
        hidden = useful * price if self.mode == "on" else last.stall_s - first.stall_s
        ms = 1e3 / tokens
        return {
            "tokens": tokens,
            "useful": useful / tokens,
            "read_price_ms": price * 1e3,
            "hidden_ms": hidden * ms,
            "cost_ms": (last.cost_s - first.cost_s) * ms,
            "token_ms": sum(times) * ms,
        }

    def _check_gain(self):
        n = self.decode_tokens - self._mode_since
        if self.mode == "on" and n >= self.settings.first_check and not self._gain_checked:
            gain = self._gain(self.settings.first_check)
            if gain is None:  # a token of unknown time (as after a reset): check at the next, a few times
                self._gain_checked = n >= 4 * self.settings.first_check
                return
            self._gain_checked = True
            self.gain = gain
            if gain["hidden_ms"] < gain["cost_ms"] + MIN_GAIN * gain["token_ms"]:
                resume_ms = max(2 * gain["cost_ms"], MIN_GAIN * gain["token_ms"])
                self.pause = dict(gain, kind="gain", at_token=self.decode_tokens, resume_stall_ms=resume_ms)
                self._back_off(
                    f"prefetch saves {gain['hidden_ms']:.2f} ms of demand reads per token and "
                    f"costs {gain['cost_ms']:.2f} ms of a {gain['token_ms']:.1f} ms token: "
                    f"paused until the demand stall grows",
                    pause="gain",
                )
        elif self.mode == "paused" and self._pause_kind == "baseline" and n >= self.settings.baseline_tokens:
            self._set_mode("on")
        elif self.mode == "paused" and self._pause_kind == "gain" and n >= self.settings.probe_tokens:
            stall = self._gain(self.settings.probe_tokens)
            if stall is not None and stall["hidden_ms"] > max(
                self.pause["resume_stall_ms"], MIN_GAIN * stall["token_ms"]
            ):
                self._set_mode("on")

    def _check_cost(self):
        """Every `probe_every` tokens with prefetch on, run `probe_tokens` with it off and compare token
        times (the first two of each stretch skipped: earlier prefetches still land)."""
        s = self.settings
        n = self.decode_tokens - self._mode_since
        every = s.first_probe if self.probe is None else s.probe_every  # decide early, then check
        if self.mode == "on" and n >= every:
            self._set_mode("probe")
        elif self.mode == "probe" and n >= s.probe_tokens:
            on, off = (self._token_seconds(mode)[-(s.probe_tokens - 2) :] for mode in ("on", "probe"))
            if on and off:
                self.probe = {"on_ms": 1e3 * float(np.mean(on)), "off_ms": 1e3 * float(np.mean(off))}
            if on and off and np.mean(off) < np.mean(on) * (1 - COST_MARGIN):
                self.pause = dict(self.probe, kind="cost", at_token=self.decode_tokens, tokens=s.pause_tokens)
                self._back_off(
                    f"prefetch costs more than it saves: {self.probe['on_ms']:.1f} ms/token "
                    f"with it, {self.probe['off_ms']:.1f} without; paused for {s.pause_tokens} tokens",
                    pause="cost",
                )
            else:
                self._set_mode("on")
        elif self.mode == "paused" and n >= s.pause_tokens:
            self._set_mode("on")

    def _check_reads(self):
        """Whether the read path is the bottleneck: the share of the last `read_window` decode tokens' time
        the generation thread waited for expert reads (demand reads and late prefetches)."""
        marks = self._marks[-self.settings.read_window - 1 :]
        if len(marks) <= self.settings.read_window or any(
            m.seconds is None or m.mode == "prefill" for m in marks[1:]
        ):
            return
        self.stall_share = (marks[-1].stall_s - marks[0].stall_s) / max(
            sum(m.seconds for m in marks[1:]), 1e-9
        )
        if self.stall_share >= READ_BOUND_ENTER:
            self.read_bound = True
        elif self.stall_share < READ_BOUND_LEAVE:
            self.read_bound = False

    def _back_off(self, reason: str, pause: str | None = None):
        """Count a back-off; with `pause` ("gain" or "cost"), pause prefetch for that reason."""
        self.backoffs += 1
        self.backoff_reason = reason
        if pause:
            self._set_mode("paused", pause)

    def _demand_totals(self) -> tuple[float, float]:
        """Experts read on the generation thread in decode, and its seconds doing so."""
        return self.ledger.total("experts_read", "decode"), self.ledger.total("read_s", "decode")

    def _token_seconds(self, mode: str) -> list[float]:
        return [m.seconds for m in self._marks if m.mode == mode and m.seconds is not None]

    def _set_mode(self, mode: str, pause_kind: str | None = None):
        self.mode, self._mode_since, self._pause_kind = mode, self.decode_tokens, pause_kind
        self._gain_checked = False
