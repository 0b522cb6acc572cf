"""Prediction across a seam of the pipeline: the rank before a seam predicts the next rank's first MoE layer
and sends the prediction ahead of the hidden state, so that the next rank's reads start before its turn.

Hidden states flow from the highest rank down (`rank_split.py`): rank r+1 computes the layers before rank
r's. With next-gate prefetch each rank predicts its next MoE layer from the current one's input; at its
last MoE layer it has no next layer of its own. So `rank_split.split` keeps the router of the next rank's
first MoE layer on the rank before (`Stage.next_router`: one dense float32 matrix), and `SeamSender`,
wrapped around that rank's policy, applies it to its last MoE layer's input, lets the runtime evaluate it
with that layer's routing (the layer's one sync, as next-gate's own predictions), and sends the ids and
scores on the heartbeat connection (`heartbeat.py`) at once: before that layer's missing experts are read,
before its experts compute and the hidden state is sent. `SeamReceiver`, on the next rank, hands them to
its loader as a prediction for its own first MoE layer (`Loader.submit`: the governor's limits, only
experts not resident): its reader threads read them while the rank waits for the hidden state. A
prediction that comes once the layer has run is dropped (booked as late).

Measured (`SeamReceiver.counts`, while `watch` is on: it adds one sync where the hidden state is received):
of the reads asked for the first layer, how many had started when the hidden state came. Across more than
two ranks the hub (rank 0) relays a seam message between two other ranks. Not here: the split
(`rank_split.py`), what a policy predicts (`prefetch/policies.py`), reading (`per_layer/reader.py`).
"""

import threading

import mlx.core as mx
import numpy as np

from ..model_surgery.routing import next_gate
from ..per_layer.loader import Loader
from ..per_layer.passes import Passes
from ..prefetch.policies import NextGatePolicy, Prediction, Step, last_row, softmax_topk


class SeamSender:
    """The rank's policy, which at its last MoE layer also predicts the next rank's first MoE layer (with
    that layer's router) and sends the prediction on: to rank `to`, tagged with the pass."""

    def __init__(self, policy: NextGatePolicy, router: tuple, passes: Passes, supervisor, last: int, to: int):
        self.policy, self.passes, self.supervisor = policy, passes, supervisor
        self.weights, self.biases = mx.array(router[0]), mx.array(router[1])
        self.last, self.to = last, to
        self._lazy: tuple[mx.array, mx.array] | None = None  # this pass's prediction (ids, scores), lazy
        self.on = True  # off: the policy alone, to compare (`send_predictions`)
        self.sent = 0  # predictions sent (one per decode pass that predicted)

    def __getattr__(self, name):  # name, optimistic_passes, prompt_start, next_uses...: the policy's
        return getattr(self.policy, name)

    def send_predictions(self, on: bool):
        """Predict and send across the seam (on) or leave the policy alone (off: to compare)."""
        self.on = on

    def before_layer(self, step: Step) -> list[Prediction]:
        predictions = self.policy.before_layer(step)
        # a step that predicts carries its hidden state (`Step.hidden`)
        if step.layer == self.last and step.predict and self.on and step.hidden is not None:
            scores = next_gate(last_row(step.hidden), self.weights, self.biases)
            ids, probs = softmax_topk(scores[:, 0], self.policy.per_layer)
            self._lazy = (ids[0], mx.minimum(probs[0] * self.policy.top_k, 1.0))
        return predictions

    def pending(self) -> list[mx.array]:
        return self.policy.pending() + list(self._lazy or ())

    def after_routing(self, step: Step, ids: np.ndarray):
        self.policy.after_routing(step, ids)
        if self._lazy is not None and step.layer == self.last:  # evaluated with this layer's routing
            experts, scores = (np.array(a).tolist() for a in self._lazy)
            self._lazy = None
            message = {"k": "seam", "to": self.to, "pass": self.passes.clock}
            self.supervisor.send(dict(message, ids=experts, scores=scores), to=0)  # rank 0 relays it on
            self.sent += 1


class SeamReceiver:
    """The next rank's side: queues each prediction for its first MoE layer with the rank's `loader` (where
    passes stand: `passes`), and (with `watch`) counts the asked reads that had started when the hidden
    state came."""

    def __init__(self, passes: Passes, loader: Loader):
        self.passes, self.loader = passes, loader
        self.lock = threading.Lock()
        self.asked: dict[int, list[int]] = {}  # pass -> experts asked to be read for layer 0
        self.received = 0  # the last pass whose hidden state came (counted only while watching)
        self.counts = {"predictions": 0, "late": 0, "reads": 0, "started_before_hidden_state": 0}

    def on_message(self, _peer: int, message: dict):
        """A prediction for this rank's first MoE layer in pass `message["pass"]` (reader thread)."""
        passes, t = self.passes, message["pass"]
        with self.lock:
            self.counts["predictions"] += 1
            waiting = t == passes.clock + 1 or (t == passes.clock and passes.layer == 0)
            if self.loader.governor is None or not waiting or t <= self.received:
                self.counts["late"] += 1
                return
            wanted = self.loader.submit(
                [Prediction(0, np.array(message["ids"]), np.array(message["scores"]))]
            )
            self.asked[t] = [int(e) for e in wanted.get(0, ())]

    def hidden_state_came(self):
        """Called where this rank receives the hidden state (`rank_split.Seam.watch_with`): count the reads
        asked for this pass that had started (no longer waiting in the reader's queue)."""
        with self.lock:
            t = self.passes.clock + 1  # the pass about to run its first layer
            self.received = t
            asked = self.asked.pop(t, [])
            self.asked = {k: v for k, v in self.asked.items() if k > t}
            started = self.loader.reader.started(0, asked)
            self.counts["reads"] += len(asked)
            self.counts["started_before_hidden_state"] += sum(started)

    def fraction(self) -> float | None:
        """Of the reads asked for the first layer, those started before the hidden state came."""
        c = self.counts
        return c["started_before_hidden_state"] / c["reads"] if c["reads"] else None


def attach(engine, policy):
    """`policy` for a rank of a pipeline: wrapped to predict across the seam after this rank's layers
    where it is next-gate and the next rank's first router was kept; and this rank's receiver of the
    predictions the rank before sends (`engine.seam_receiver`, made once and returned as it is after).
    One process, or a path that reads nothing ahead (two tiers): (`policy` itself, no receiver)."""
    stage, ahead, receiver = engine.stage, engine.runtime.read_ahead(), engine.seam_receiver
    if stage is None or ahead is None:
        return policy, receiver
    supervisor = stage.supervisor
    if stage.rank < stage.size - 1 and receiver is None:
        receiver = SeamReceiver(ahead.passes, ahead.loader)
        supervisor.handle("seam", receiver.on_message)
    if stage.rank == 0 or stage.next_router is None or not isinstance(policy, NextGatePolicy):
        return policy, receiver
    sender = SeamSender(
        policy, stage.next_router, ahead.passes, supervisor, len(engine.caches) - 1, stage.rank - 1
    )
    return sender, receiver


def watch(engine, on: bool = True):
    """Count, where this rank receives the hidden state, the seam's reads started by then
    (`SeamReceiver.counts`; one more sync a pass while on)."""
    from .rank_split import Seam

    stage = engine.stage
    owner = dict(engine.model.named_modules())[stage.layers_path] if stage.layers_path else engine.model
    seam = owner.layers[stage.start]
    if isinstance(seam, Seam) and engine.seam_receiver is not None:
        seam.watch_with(engine.seam_receiver.hidden_state_came if on else None)
