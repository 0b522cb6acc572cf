"""Three tiers on trained routing: how much of the disk's stall could the shadow predictor hide?

Question (issue #72): with device slots, a bounded host tier and the checkpoint on disk, a routed expert in
neither tier is a disk read that stalls its layer. If the shadow predictor reads the next layers' experts
from disk into the host tier ahead, how many of those stalled reads become host hits, at what cost in
wasted reads, against demand-only reads, Belady's MIN and an oracle that knows the routing?

Command (from the repository root; under a minute on two cores):

    python lab/three_tiers/simulate.py

What it does. Loads the bundled model (`od_moe.DEFAULT_MODEL`, every expert resident) with its bundled
shadow predictor; decodes 6 prompts greedily, 65 tokens each (64 decode passes after the prefill): the
three of `od_moe.bench.foundation.PROMPTS` and the openings of three held-out documents of the bundled
training text (`split_documents`, the documents the predictor did not train on). Each prompt and its
completion is then run once more, teacher-forced, through `training/record.py`'s taps, which give per
token and MoE layer the block's input (hidden state), the router's logits and the routed ids, as
`od-moe eval-predictor` records them; the predictor's scores for the next layers come from
`training/evaluate.py`'s `predictor_scores` (the previous token's router log-probabilities included, as
`PredictorPolicy` feeds them), next-gate's from `next_gate_logits` (the next layer's router on this
layer's input, as `NextGatePolicy`). The routing of the decode passes (not the prefill) is replayed
through three non-overlapping tiers per MoE layer: D device slots (LRU), H host slots, the rest on disk,
tiers persisting from one prompt to the next (as a server's would). The replay checks that the
teacher-forced routing equals the routing the engine's own decode recorded (`record_routing`).

Policies, each per layer: `demand` reads a routed expert in neither tier from disk at its layer (a
stalled read) into the device tier; the device's LRU victim moves to the host tier, whose LRU victim is
dropped; a host hit moves to the device tier and the device's victim takes its host slot. `min`: Belady's
MIN over the device and host tiers together (D + H slots: with demand reads only, an expert in either tier
avoids the disk), `od_moe/caching/replay.py`; its reads are all stalled. `predictor@d`: demand as above
and, after layer l routes, the predictor's top P = 8 experts for each of layers l+1..l+d (within the pass:
the bundled predictor predicts no further) that are in neither tier are read from disk into that layer's
host tier ahead. Each prediction has a rank, P(routed) = min(1, k x softmax probability) times 0.8 per
layer of distance (as `PredictorPolicy` ranks them); host eviction takes unpredicted experts first, least
recently used first, then the lowest-ranked prediction, and a read ahead is not issued where the host
tier holds only predictions ranked above it. Predictions for a layer lapse once it routes. `next-gate@1`:
the same, with the next layer's router on the current input. `oracle@d`: reads ahead exactly the experts
routed at the next d layers (running on into the next pass, as `OraclePolicy`), host eviction by true
next use (Belady). Stall hidden = (demand stalled - policy stalled) / (demand stalled - oracle@d
stalled), the same (D, H) and d (d = 1 for next-gate).

Counted per decoded token (all 8 MoE layers together): disk reads (stalled + ahead), stalled reads (an
expert needed at the layer it was read in), reads ahead later routed while still in the host tier
(useful) and dropped before any use (wasted); reads ahead still unused in the host tier at the end are in
`pending` of the JSON only.

Not modelled: time. A read ahead counts as hidden however late it would land (d = 1 leaves one layer's
compute for it); the disk's rate, queue depth, reader threads and the compute per layer are not here, nor
copies from host to device ahead of need (a host hit is counted, not timed), nor the prefill's reads
(it is not replayed; its routing would warm the tiers), nor `NextTokenLens` (the last layer's guess of
the next token's first layer), nor the live predictor's halving of experts with distance
(`experts_at_distance`: here P = 8 at every distance). One small model: 64 experts, top-8, 8 MoE layers,
its routing far from a large model's.

Writes `lab/runs/three-tier-sim-cpu/simulation.json` (the command, the commit, every figure) and
`table.txt`, and prints the table. Deterministic: greedy decoding, CPU arithmetic, ties broken by expert id.
"""

import bisect
import gzip
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

import od_moe
from od_moe.accounting.report import table
from od_moe.bench.foundation import PROMPTS
from od_moe.caching.replay import replay_layers
from od_moe.prefetch.policies import DISTANCE_DISCOUNT as DISCOUNT
from od_moe.storage.model_files import DEFAULT_PREDICTOR
from od_moe.training.bundled import BUNDLED_TEXT
from od_moe.training.data import Documents, split_documents
from od_moe.training.evaluate import next_gate_logits, predictor_scores
from od_moe.training.record import record_sequence

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "lab" / "runs" / "three-tier-sim-cpu"
TOKENS = 65  # generated per prompt: the prefill gives the first, 64 decode passes the rest
HELD_OUT_PROMPTS, PROMPT_CHARS = 3, 160
ROWS = ((16, 8), (16, 16), (8, 8))
PER_LAYER = 8  # P: experts read ahead per predicted layer
LOOKAHEADS = (1, 2, 3)


def prompts() -> list[str]:
    with gzip.open(BUNDLED_TEXT, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    _, held = split_documents(Documents(texts, "bundled:python_source", "text"))
    return list(PROMPTS) + [t[:PROMPT_CHARS] for t in held.texts[:HELD_OUT_PROMPTS]]


def record(engine, prompt: str) -> tuple[dict, int, list]:
    """Greedy decode, then the whole sequence teacher-forced through the recording taps: (trace rows,
    the prompt's length, the decode's own routing from `record_routing`)."""
    ids = engine.encode(prompt)
    tokens = [r.token for r in engine.stream_generate(ids, max_tokens=TOKENS)]
    live = engine.record_routing(ids, TOKENS)
    seq = ids + tokens[:-1]  # the last token is sampled by the last pass, never fed
    rows = record_sequence(engine, seq, chunk=len(seq))  # one forward, as `od-moe eval-predictor` records
    return rows, len(ids), live


def softmax_top(scores: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probabilities) of the m highest scores of one row, best first, ties by expert id."""
    z = np.exp(scores - scores.max())
    p = z / z.sum()
    order = np.lexsort((np.arange(len(p)), -p))[:m]
    return order, p[order]


class LayerTiers:
    """One MoE layer's device tier (LRU) and host tier, not overlapping; the rest is on disk."""

    def __init__(self, device: int, host: int, next_use=None):
        self.device_slots, self.host_slots = device, host
        self.device: OrderedDict = OrderedDict()  # expert -> None, least recently used first
        self.host: dict[int, int] = {}  # expert -> last use (or read) time
        self.ahead: set[int] = set()  # host experts read ahead and not used since
        self.rank: dict[int, float] = {}  # expert -> rank of a live prediction for this layer's next run
        self.next_use = next_use  # oracle: (expert, time) -> the expert's next routed time here
        self.now = 0
        self.counts = dict(stalled=0, ahead=0, useful=0, wasted=0, skipped=0)

    def _key(self, e: int, use: int) -> tuple:
        """Lower is evicted first: Belady for the oracle, else unpredicted by LRU, then by rank."""
        if self.next_use is not None:
            return (-self.next_use(e, self.now), e)
        return (1, self.rank[e], use, e) if e in self.rank else (0, 0.0, use, e)

    def _drop_host(self, e: int):
        del self.host[e]
        if e in self.ahead:
            self.ahead.discard(e)
            self.counts["wasted"] += 1

    def _to_host(self, e: int, use: int):
        """A device victim moves to the host tier; the host tier's victim (maybe itself) is dropped."""
        if len(self.host) < self.host_slots:
            self.host[e] = use
            return
        victim = min(list(self.host) + [e], key=lambda x: self._key(x, self.host.get(x, use)))
        if victim == e:  # needed later than every host expert: dropped at once
            self.rank.pop(e, None)
            return
        self._drop_host(victim)
        self.host[e] = use

    def _to_device(self, e: int, routed: set, last: dict):
        self.device[e] = None
        if len(self.device) > self.device_slots:
            victim = next(x for x in self.device if x not in routed)
            del self.device[victim]
            self._to_host(victim, last[victim])

    def demand(self, ids, now: int, last: dict):
        """The layer routes `ids` at time `now`; `last` keeps each expert's last use here."""
        self.now = now
        routed = set(ids)
        for e in ids:
            if e in self.device:
                self.device.move_to_end(e)
        for e in ids:
            if e in self.device:
                continue
            if e in self.host:
                del self.host[e]
                if e in self.ahead:
                    self.ahead.discard(e)
                    self.counts["useful"] += 1
            else:
                self.counts["stalled"] += 1
            self._to_device(e, routed, last)
        for e in ids:
            last[e] = now
        self.rank.clear()  # the predictions were for the run that just happened

    def read_ahead(self, e: int, rank: float, now: int):
        """A prediction for this layer's next run, made at time `now`: read from disk into the host tier
        where it is in neither tier and a host slot may be given for it."""
        self.now = now
        if self.next_use is None:
            self.rank[e] = max(rank, self.rank.get(e, 0.0))
        if e in self.device or e in self.host:
            return
        if len(self.host) >= self.host_slots:
            victim = min(self.host, key=lambda x: self._key(x, self.host[x]))
            if self._key(victim, self.host[victim]) >= self._key(e, now):
                self.rank.pop(e, None)
                self.counts["skipped"] += 1
                return
            self._drop_host(victim)
        self.host[e] = now
        self.ahead.add(e)
        self.counts["ahead"] += 1


def oracle_next_use(routing: list[list[np.ndarray]], layer: int, L: int):
    """(expert, time) -> the next time (pass x L + layer) after `time` that `layer` routes the expert."""
    times: dict[int, list[int]] = {}
    for t, step in enumerate(routing):
        for e in step[layer]:
            times.setdefault(int(e), []).append(t * L + layer)

    def next_use(e: int, now: int) -> float:
        seq = times.get(e, [])
        i = bisect.bisect_right(seq, now)
        return seq[i] if i < len(seq) else float("inf")

    return next_use


def simulate(routing, predictions, device: int, host: int, lookahead: int, oracle: bool) -> dict:
    """Replay `routing[t][l]` (sorted unique ids) through the tiers. `predictions[t][l]`: {target layer:
    (ids, ranks)} made after layer l of pass t routes (None: demand only); `oracle`: read the next
    `lookahead` layers' routing ahead, Belady in the host tier."""
    L = len(routing[0])
    tiers = [LayerTiers(device, host, oracle_next_use(routing, j, L) if oracle else None) for j in range(L)]
    last = [dict() for _ in range(L)]
    for t, step in enumerate(routing):
        for layer in range(L):
            now = t * L + layer
            tiers[layer].demand([int(e) for e in step[layer]], now, last[layer])
            if oracle:
                for d in range(1, lookahead + 1):
                    tp, j = divmod(layer + d, L)
                    if t + tp < len(routing):
                        for e in routing[t + tp][j]:
                            tiers[j].read_ahead(int(e), 0.0, now)
            elif predictions is not None:
                for j, (ids, ranks) in predictions[t][layer].items():
                    if j - layer <= lookahead:
                        for e, r in zip(ids, ranks):
                            tiers[j].read_ahead(int(e), float(r), now)
    total = {k: sum(tr.counts[k] for tr in tiers) for k in tiers[0].counts}
    total["pending"] = sum(len(tr.ahead) for tr in tiers)
    total["disk"] = total["stalled"] + total["ahead"]
    return total


def main():
    engine = od_moe.load(capacity=1.0, predictor=DEFAULT_PREDICTOR)
    predictor, routers = engine.predictor, engine.routers()
    c = predictor.config
    L, E, k = c.num_layers, c.num_experts, c.top_k
    texts = prompts()
    routing, predictions, agree, compared = [], [], 0, 0
    for s, prompt in enumerate(texts):
        rows, n_prompt, live = record(engine, prompt)
        traces = dict(rows, sequence=np.full(len(rows["tokens"]), s, np.int32))
        decode = range(n_prompt, len(rows["tokens"]))
        scores = {i: predictor_scores(predictor, traces, routers, i) for i in range(L - 1)}
        gate = {i: next_gate_logits(traces["features"], routers, i, [i + 1])[:, 0] for i in range(L - 1)}
        for n, r in enumerate(decode):
            step = [np.unique(traces["ids"][r, j]) for j in range(L)]
            routing.append(step)
            # live: mlx-lm's prefill of all but the last prompt token, that token's pass, then the decode's
            pass_ = live[2 + n] if 2 + n < len(live) else None
            if pass_ is not None:
                for j in range(L):
                    compared += 1
                    agree += bool(np.array_equal(np.unique(np.asarray(pass_[j])), step[j]))
            per_layer = []
            for i in range(L):
                pred, ng = {}, {}
                if i < L - 1:
                    for n_t, j in enumerate(c.targets(i)):
                        ids, p = softmax_top(scores[i][r, n_t].astype(np.float64), PER_LAYER)
                        pred[j] = (ids, np.minimum(p * k, 1.0) * DISCOUNT ** (j - i - 1))
                    ids, p = softmax_top(gate[i][r].astype(np.float64), PER_LAYER)
                    ng[i + 1] = (ids, np.minimum(p * k, 1.0))
                per_layer.append((pred, ng))
            predictions.append(per_layer)
    passes = len(routing)
    pred_only = [[pl[0] for pl in step] for step in predictions]
    gate_only = [[pl[1] for pl in step] for step in predictions]

    results = []
    for device, host in ROWS:
        demand = simulate(routing, None, device, host, 0, False)
        steps = [[step[j] for step in routing] for j in range(L)]
        belady = replay_layers(steps, device + host, "min")
        oracles = {d: simulate(routing, None, device, host, d, True) for d in LOOKAHEADS}
        entries = [("demand", 0, demand)]
        entries.append(("min", 0, dict(disk=belady.reads, stalled=belady.reads, ahead=0, useful=0, wasted=0)))
        entries += [
            (f"predictor@{d}", d, simulate(routing, pred_only, device, host, d, False)) for d in LOOKAHEADS
        ]
        entries.append(("next-gate@1", 1, simulate(routing, gate_only, device, host, 1, False)))
        entries += [(f"oracle@{d}", d, oracles[d]) for d in LOOKAHEADS]
        for name, d, fig in entries:
            hideable = demand["stalled"] - oracles[d]["stalled"] if d else None
            hidden = (demand["stalled"] - fig["stalled"]) / hideable if hideable else None
            results.append(
                dict(
                    device=device,
                    host=host,
                    policy=name,
                    lookahead=d,
                    counts=fig,
                    per_token={
                        key: fig[key] / passes for key in ("disk", "stalled", "ahead", "useful", "wasted")
                    },
                    wasted_of_reads=fig["wasted"] / fig["disk"] if fig["disk"] else 0.0,
                    stall_hidden=hidden,
                )
            )

    headers = [
        "D+H of 64",
        "policy",
        "disk/tok",
        "stalled/tok",
        "useful/tok",
        "wasted/tok",
        "wasted/reads",
        "hidden",
    ]
    rows_out = [
        [
            f"{r['device']}+{r['host']}",
            r["policy"],
            f"{r['per_token']['disk']:.2f}",
            f"{r['per_token']['stalled']:.2f}",
            f"{r['per_token']['useful']:.2f}",
            f"{r['per_token']['wasted']:.2f}",
            f"{r['wasted_of_reads']:.2f}",
            "-" if r["stall_hidden"] is None else f"{r['stall_hidden']:.2f}",
        ]
        for r in results
    ]
    title = (
        f"Three tiers, bundled model, trained routing: {len(texts)} prompts, {passes} decode passes, "
        f"P={PER_LAYER}; teacher-forced routing equals the decode's at {agree}/{compared} (pass, layer)"
    )
    print(table(headers, rows_out, title))
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    OUT.mkdir(parents=True, exist_ok=True)
    record_out = dict(
        command="python lab/three_tiers/simulate.py",
        commit=commit,
        model=str(od_moe.DEFAULT_MODEL.relative_to(ROOT)),
        predictor=str(DEFAULT_PREDICTOR.relative_to(ROOT)),
        predictor_lookahead=c.lookahead,
        num_layers=L,
        num_experts=E,
        top_k=k,
        prompts=texts,
        tokens_per_prompt=TOKENS,
        decode_passes=passes,
        routing_agreement=dict(equal=agree, compared=compared),
        per_layer_ahead=PER_LAYER,
        rows=results,
        argv=sys.argv,
    )
    (OUT / "table.txt").write_text(table(headers, rows_out, title) + "\n")
    (OUT / "simulation.json").write_text(json.dumps(record_out, indent=1, default=float))


if __name__ == "__main__":
    main()
