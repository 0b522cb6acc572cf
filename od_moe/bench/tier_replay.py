"""Three tiers replayed on a model's own decode routing: what each read-ahead policy would read from disk,
waste and wait for, with a disk rate and a layer's compute measured on the machine the figures are for.

`record_decode` decodes prompts greedily on the per-layer path (every expert resident), runs each prompt and
its completion once more teacher-forced through the trace taps (`training/record.py`), and keeps, per
decoded token and MoE layer, the routed experts and what the forecasts are made from (the block's input
and the router's logits). `forecasts` turns those into what the shadow network (`predictor_scores`, as
`od-moe eval-predictor` scores it) or next-gate (the later layer's router on this layer's input) would
read ahead; `replay_rows` replays every policy through the same tiers (`caching/tier_replay.py`) and
returns the bench's rows. Not here: the live three tiers (`two_tier/host_tier.py`), or timing anything.
"""

from dataclasses import dataclass

import numpy as np

from ..caching.tier_replay import Forecast, TierClock, TierFigures, replay_tiers
from ..prefetch.policies import DISTANCE_DISCOUNT
from ..training.evaluate import next_gate_logits, predictor_scores
from ..training.next_use import trace_distances
from ..training.record import record_sequence


@dataclass
class DecodeRecording:
    """Decoded passes of some prompts, recorded: `routing[t][layer]` (sorted ids), and the rows of the
    teacher-forced traces (`traces`: features, logits, ids, sequence) that are decode passes (`rows[t]`)."""

    routing: list[list[np.ndarray]]
    traces: dict
    rows: np.ndarray
    agreement: tuple[int, int]  # (layer passes whose teacher-forced routing equals the decode's, compared)


def record_decode(engine, prompts: list[str], max_tokens: int) -> DecodeRecording:
    """Decode each prompt greedily (`max_tokens` tokens) and record its decode passes (`engine`: the per-layer
    path, where the trace taps sit). The routing replayed is the teacher-forced one; how often it equals the
    decode's own (`record_routing`) is kept in `agreement`."""
    parts, rows, agree, compared, offset = [], [], 0, 0, 0
    for s, prompt in enumerate(prompts):
        ids = engine.encode(prompt)
        tokens = [r.token for r in engine.stream_generate(ids, max_tokens=max_tokens)]
        live = engine.record_routing(ids, max_tokens)
        seq = ids + tokens[:-1]  # the last token is sampled by the last pass, never fed
        trace = record_sequence(engine, seq)
        trace["sequence"][:] = s
        for n, r in enumerate(range(len(ids), len(seq))):
            # live: mlx-lm's prefill of all but the last prompt token, that token's pass, then the decode's
            if 2 + n < len(live):
                for j, routed in live[2 + n].items():
                    compared += 1
                    agree += bool(np.array_equal(np.unique(np.asarray(routed)), trace["ids"][r, j]))
            rows.append(offset + r)
        parts.append(trace)
        offset += len(seq)
    traces = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    routing = [[np.unique(traces["ids"][r, j]) for j in range(traces["ids"].shape[1])] for r in rows]
    return DecodeRecording(routing, traces, np.array(rows), (agree, compared))


def _ranked(scores: np.ndarray, m: int, k: int, distance: int) -> tuple[np.ndarray, ...]:
    """The m best of one row of scores (ties by expert id), their ranks (min(1, k x softmax probability),
    discounted with distance as `PredictorPolicy` ranks them) and k x their probability."""
    z = np.exp(scores - scores.max())
    p = z / z.sum()
    order = np.lexsort((np.arange(len(p)), -p))[:m]
    confidence = p[order] * k
    return order, np.minimum(confidence, 1.0) * DISTANCE_DISCOUNT ** (distance - 1), confidence


def forecasts(
    recording: DecodeRecording,
    routers,
    top_k: int,
    per: int,
    distance: int,
    predictor=None,
    floor: float = 0.0,
) -> Forecast:
    """What the shadow `predictor` (None: next-gate) reads ahead from each decode pass's layers: its `per`
    best experts of each of the next `distance` layers in the pass, those whose `top_k` x probability is at
    least `floor` (`ForecastSettings.floor`)."""
    traces, rows = recording.traces, recording.rows
    L = traces["ids"].shape[1]
    ahead: list[list[dict]] = [[{} for _ in range(L)] for _ in rows]
    for i in range(L - 1):
        if predictor is not None:
            targets = predictor.config.targets(i)
            scores = predictor_scores(predictor, traces, routers, i)
        else:
            targets = list(range(i + 1, min(i + distance, L - 1) + 1))
            scores = next_gate_logits(traces["features"], routers, i, targets)
        for n, j in enumerate(targets):
            if j - i > distance:
                continue
            for t, r in enumerate(rows):
                ids, ranks, confidence = _ranked(scores[r, n].astype(np.float64), per, top_k, j - i)
                sure = confidence >= floor
                ahead[t][i][j] = ids[sure], ranks[sure]
    name = "predictor" if predictor is not None else "next-gate"
    return Forecast(f"{name}@{distance}", ahead)


@dataclass(frozen=True)
class ReplayRow:
    """One policy on one pair of tiers, and the figures that judge it against demand and the oracle."""

    device: int
    host: int
    policy: str
    eviction: str
    figures: TierFigures
    all_in_host_ms: float  # the layers' compute a token
    roofline_ms: float  # max(all in host, the demand row's disk bytes a token / the disk's rate)
    hidden: float | None  # (T_demand - T) / (T_demand - T_oracle at the same distance)

    def as_dict(self) -> dict:
        return dict(
            device=self.device,
            host=self.host,
            policy=self.policy,
            eviction=self.eviction,
            figures=self.figures.as_dict(),
            all_in_host_ms=self.all_in_host_ms,
            roofline_ms=self.roofline_ms,
            hidden=self.hidden,
        )


def next_use_distances(recording: DecodeRecording, predictor) -> np.ndarray | None:
    """(decode passes, layers, experts): the predictor's next-use head's estimates after each decode pass
    (None where it has no such head)."""
    if not predictor.config.next_use:
        return None
    E = predictor.config.num_experts
    return trace_distances(predictor.next_use, recording.traces, E)[recording.rows]


def replay_rows(
    routing: list[list[np.ndarray]],
    tiers: list[tuple[int, int]],
    clock: TierClock,
    policies: list[Forecast],
    distances: list[int],
    warm: int,
    distances_ahead: np.ndarray | None = None,
    **options,
) -> list[ReplayRow]:
    """Per (device, host) pair: demand only, the oracle at each distance, and each forecast with host
    eviction by recency and by predicted next use, and where the next-use head's estimates are given
    (`distances_ahead`, passes x layers x experts) by them too, all replayed on `routing` after `warm`
    passes (`options`: `replay_tiers`' live_tables, demand_first, routed_ahead, slots, admission)."""
    return [
        row
        for device, host in tiers
        for row in _pair_rows(
            routing, device, host, clock, policies, distances, distances_ahead, warm=warm, **options
        )
    ]


def _pair_rows(
    routing, device, host, clock, policies, distances, distances_ahead, **options
) -> list[ReplayRow]:
    def run(eviction: str = "lru", **kw) -> TierFigures:
        head = distances_ahead if eviction == "next-use" else None
        return replay_tiers(routing, device, host, clock, eviction=eviction, distances=head, **options, **kw)

    demand = run()
    all_in_host = len(routing[0]) * clock.layer_ms
    roofline = max(all_in_host, demand.per_token("reads") * clock.read_ms)
    oracle = {d: run(oracle_distance=d) for d in distances}
    evictions = ["lru", "predicted"] + ([] if distances_ahead is None else ["next-use"])
    rows: list[tuple[str, str, TierFigures, int | None]] = [("demand", "lru", demand, None)]
    if distances_ahead is not None:
        rows.append(("demand", "next-use", run("next-use"), distances[0]))
    rows += [(f"oracle@{d}", "true next use", oracle[d], d) for d in distances]
    for forecast in policies:
        d = int(forecast.name.rsplit("@", 1)[1])
        rows += [(forecast.name, e, run(e, forecast=forecast), d) for e in evictions]
    out = []
    for policy, eviction, figures, at in rows:
        hideable = demand.token_ms - oracle[at].token_ms if at else 0.0
        hidden = (demand.token_ms - figures.token_ms) / hideable if hideable > 0 else None
        out.append(ReplayRow(device, host, policy, eviction, figures, all_in_host, roofline, hidden))
    return out
