"""Where generation stands, as the per-layer path and its reads see it.

`Passes` is moved forward by the runtime (`per_layer_runtime.py`, one forward pass at a time, through the
methods below) and read by the reads and installs (`loader.py`) and the seam between ranks
(`distributed/seams.py`): the clock of cache uses (forward passes so far), the running pass's phase and
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
        self._next_uses = True  # `future` asks the policy (`use_policy`)

    def use_policy(self, policy, next_uses: bool = True):
        """Run `policy`'s hooks from now on; `next_uses=False`: `future` knows nothing, whatever the policy
        estimates (`PrefetchSettings.next_use_estimates`)."""
        self.policy, self._next_uses = policy, next_uses

    def start_prompt(self):
        """A new prompt: passes count from zero again."""
        self.in_prompt = 0

    def start_recording(self):
        """Record the routing of every pass from now on (`record`)."""
        self.recording = []

    def stop_recording(self) -> list[dict[int, np.ndarray]] | None:
        """The routing recorded since `start_recording`, per pass {layer: ids (tokens, k)} (None: nothing
        was being recorded); recording stops."""
        recording, self.recording = self.recording, None
        return recording

    def at_layer(self, layer: int, new_pass: bool = False):
        """The running pass reached MoE layer `layer`; `new_pass`: the first layer of a pass not run before,
        whose index within the prompt the policy's hooks see from here (the clock moves at `start`, once
        the hooks of the pass that ended have run)."""
        if new_pass:
            self.index = self.in_prompt
        self.layer = layer

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
        if not self._next_uses:
            return None
        reached = self.layer is not None and layer <= self.layer
        return self.policy.next_uses(self.index if reached else self.index - 1, layer)
