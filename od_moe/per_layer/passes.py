"""Where generation stands, as the per-layer path and its reads see it.

`Passes` is moved forward by the runtime (`per_layer_runtime.py`, one forward pass at a time) and read by the
reads
and installs (`loader.py`): the clock of cache uses (forward passes so far), the running pass's phase and
index within its prompt (oracle traces are indexed by it), the layer `route` is at, the routing being
recorded, and the prefetch policy, which may know when each expert is needed next (`future`). Not here:
what a pass does (`per_layer_runtime.py`), counting (`accounting/ledger.py`).
"""

import numpy as np

from ..prefetch.policies import OnDemand


class Passes:
    """The forward passes so far, the running one, and the policy that may know the future."""

    def __init__(self):
        self.policy = OnDemand()
        self.clock = 0  # forward passes so far: the time of cache uses
        self.phase = "prefill"  # of the running pass
        self.in_prompt = 0  # passes since the prompt started
        self.index = 0  # the running pass's index within its prompt
        self.layer: int | None = None  # the layer of the running pass that `route` is at
        self.recording: list[dict[int, np.ndarray]] | None = None  # per pass, {layer: routed ids}

    def start(self, phase: str):
        """A forward pass starts."""
        self.phase = phase
        self.clock += 1
        self.in_prompt += 1
        if self.recording is not None:
            self.recording.append({})

    def record(self, layer: int, ids: np.ndarray):
        """The running pass's routing at `layer`, where it is being recorded."""
        if self.recording:
            self.recording[-1][layer] = ids.reshape(-1, ids.shape[-1])

    def future(self, layer: int) -> np.ndarray | None:
        """Passes until each expert of `layer` is needed again, where the policy knows (the oracle);
        a layer the running pass has not reached yet still has this pass's use ahead of it."""
        reached = self.layer is not None and layer <= self.layer
        return self.policy.next_uses(self.index if reached else self.index - 1, layer)
