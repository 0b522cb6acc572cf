"""What two-tier mode puts into the model (`TwoTierSwitch` for each switch, `CompiledBlock` for each MoE
block), and a layer's pass of one position as one compiled MLX call: how its lanes find their rows (the
slots' table, the row kernel's copies, a staging copy) and mlx-lm's switch on those rows (`LayerSteps`),
or mlx-lm's whole MoE block around them: router, top-k, the switch, the weighted sum (`CompiledBlock`).

A decoded token on a fast GPU waits on the host (docs/GPU.md, "Where a decoded token's time
goes"): at every pass Python makes each MLX operation of a layer's router, its lookups and mlx-lm's switch
(`SwitchGLU`: three `gather_qmm`s and the activation). `mx.compile` traces a step once per input shapes
and MLX replays it with none of that Python. The operations are the same ones on the same bytes, so the
tokens are stock mlx-lm's (the suite compares them). Only one position's passes are compiled: their shapes
repeat at every decoded token, while a prompt's would trace anew for each length. What a pass takes and
gives besides the hidden state (tables, the rows' state, hits) is a `Plan`, made by the runtime per layer
and pass: the host's decisions stay outside the compiled call, the arrays go in and out of it. Each layer's
pass enters the runtime once (`TwoTierRuntime.layer_pass`, from the block, else the switch) and computes in
a `LayerPass`, which hands the routed ids back to the runtime; a compiled block's trace in a `Trace`.
Not here: what the lanes read and what is kept of their outputs (`two_tier_runtime.py`, `kept_rows.py`,
`staged_passes.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..model_surgery.switch_over import switch_on


@dataclass
class Plan:
    """How a layer's pass of one position computes: `lanes(indices, *state)` -> (the arrays to compute on,
    in the stack's order; the row each lane reads in them; a tuple of other outputs), and what the host
    keeps of those outputs (`finish(layer, outputs)`)."""

    key: tuple  # names the path and everything `lanes` closes over (the compiled call's key)
    lanes: Callable
    state: tuple  # the arrays `lanes` reads besides the routed ids
    finish: Callable | None = None


class LayerSteps:
    """mlx-lm's switch of one layer, copied so that it holds none of the stack's arrays between calls, and
    the compiled steps made over it."""

    def __init__(self, stacked: nn.Module, keys):
        self.keys = list(keys)  # the stack's (projection, array name), in the order arrays are given
        self.switch = switch_on(stacked, dict.fromkeys(self.keys))
        # for traces: the products' batch indices constants of the compiled call
        self.traced_switch = switch_on(stacked, dict.fromkeys(self.keys), rows_given=True)
        self._compiled: dict = {}

    def compute(self, arrays, x: mx.array, indices: mx.array, traced: bool = False) -> mx.array:
        """`switch(x, indices)` on `arrays` (in `keys`' order), set for this call only: afterwards the
        switch keeps none of them alive. traced: the products' batch indices given (`switch_on`'s
        rows_given), for a trace."""
        switch = self.traced_switch if traced else self.switch
        for (proj, name), array in zip(self.keys, arrays):
            switch[proj][name] = array
        try:
            return switch(x, indices)
        finally:
            for proj, name in self.keys:
                switch[proj][name] = None

    def run(self, lanes, x: mx.array, inputs: tuple):
        """(the switch's output, the lanes' other outputs) for `x`, as traced for `mx.compile` (by `step`,
        or inside a compiled block's trace): `lanes(*inputs)` as `step` takes them; the products' batch
        indices constants of the trace."""
        arrays, read, outputs = lanes(*inputs)
        return self.compute(arrays, x, read, traced=True), outputs

    def step(self, key, make):
        """The compiled call (x, inputs) -> (the switch's output, the lanes' other outputs) for `key`, which
        names everything the lanes close over. `make()` (called once) gives the lanes: `lanes(*inputs)` ->
        (the arrays to compute on, in `keys`' order; the row each lane reads in them; a tuple of other
        outputs)."""
        if key not in self._compiled:
            lanes = make()
            self._compiled[key] = mx.compile(lambda x, inputs: self.run(lanes, x, inputs))
        return self._compiled[key]


def as_routed(indices: mx.array, *arrays):
    """Lanes that read the rows they are routed to (every expert in its own row)."""
    return arrays, indices, ()


def through_table(indices: mx.array, table: mx.array, *arrays):
    """Lanes that read the row the table gives their expert; the other output: which are hits (a row
    past the experts' own, E + slot)."""
    read = table[indices]
    return arrays, read, (read >= table.shape[0],)


class TwoTierSwitch(nn.Module):
    """Drop-in `switch_mlp`: mlx-lm's switch (`stacked`) over the layer's stack, experts and slots."""

    def __init__(self, stacked: nn.Module, runtime, layer: int):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "stacked", stacked)  # not a child: the stack is no parameter of the model
        object.__setattr__(self, "runtime", runtime)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.runtime.switch(self.layer, x, indices)


class LayerPass:
    """A MoE layer's pass in progress (`TwoTierRuntime.layer_pass`): its plan, and what its switch computed
    with, which the runtime books: the routed ids, and the plan's other outputs. With a plan the switch is
    one compiled call (`LayerSteps.step`), else op by op (`eager(x, indices)`)."""

    def __init__(self, plan: Plan | None, eager: Callable):
        self.plan, self.eager = plan, eager
        self.indices, self.outputs = None, ()

    def switch(self, steps: LayerSteps, x: mx.array, indices: mx.array) -> mx.array:
        self.indices, plan = indices, self.plan
        if plan is None:
            return self.eager(x, indices)
        y, self.outputs = steps.step(plan.key, lambda: plan.lanes)(x, (indices, *plan.state))
        return y


@dataclass
class CompileVerdict:
    """Whether a model's MoE blocks compile to the bits they give op by op (`CompiledBlock.compiles_exactly`):
    None until a block answers, False from the first that does not, else True; `asked`: the layers that
    answered."""

    exact: bool | None = None
    asked: set = field(default_factory=set)

    def check(self, block: "CompiledBlock", x: mx.array):
        """`block`'s answer on `x` (its first pass of one position) booked, once a layer, while no block
        has said no."""
        if block.layer in self.asked or self.exact is False:
            return
        self.asked.add(block.layer)
        exact = block.compiles_exactly(x)  # None where this block cannot be traced: it runs op by op
        if exact is not None:
            self.exact = exact


class CompiledBlock(nn.Module):
    """mlx-lm's MoE block (`inner`) in two-tier mode, each call the layer's pass (the runtime's
    `layer_pass`): a pass of one position computed as one compiled call per plan (`one_position`) where
    that is exact (`verdict`, shared by the model's blocks: one that is not sends all op by op), any
    other as `inner` itself, its switch computing in the pass. `stack`: the layer's stack arrays, experts
    first in expert order."""

    def __init__(self, inner: nn.Module, runtime, layer: int, stack: tuple, verdict: CompileVerdict):
        super().__init__()
        self.inner = inner
        self.layer = layer
        object.__setattr__(self, "runtime", runtime)  # not a child
        object.__setattr__(self, "_compiled", {})
        object.__setattr__(self, "stack", stack)  # not parameters of the model
        object.__setattr__(self, "verdict", verdict)
        self.traceable = True  # False once the block proved not traceable (it waits for an array)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self.runtime.layer_pass(self.layer, x, lambda step: self._compute(step, x, args, kwargs))

    def _compute(self, step: LayerPass, x: mx.array, args, kwargs) -> mx.array:
        """The layer's pass `step` of `x`: its plan as one compiled call where that is exact, else `inner`
        op by op, its switch computing in `step`."""
        # one position (a forecast reads the block's input before the call, and its copies are calls of
        # their own: `KeptRows.plan`)
        one = x.size == x.shape[-1] and not (args or kwargs) and self.traceable
        if one:
            self.verdict.check(self, x)
        plan = step.plan
        if plan is not None and one and self.traceable and self.verdict.exact:
            if plan.key not in self._compiled:
                self._compiled[plan.key] = mx.compile(self._traced(plan.lanes))
            try:
                y, step.indices, step.outputs = self._compiled[plan.key](x, plan.state)
            except ValueError:  # MLX refuses a trace that evaluates an array: the block runs as it is
                self.traceable = False
            else:
                return y
        return self._within(step, lambda: self.inner(x, *args, **kwargs))

    def _within(self, opened, run: Callable):
        """`run()` with `opened` (a `LayerPass` or a `Trace`) the pass the block's switch computes in."""
        runtime = self.runtime
        outer, runtime.open = runtime.open, opened
        try:
            return run()
        finally:
            runtime.open = outer

    def compiles_exactly(self, x: mx.array) -> bool | None:
        """Whether the block compiled gives, on `x`, the bits it gives op by op (as stock mlx-lm runs it),
        each routed expert read where it is mapped. Compiling fuses the block's elementwise operations
        into one kernel, which on CUDA can round otherwise: Qwen3-Next's shared-expert gate (a sigmoid,
        a product and a sum) did (docs/GPU.md, "Exact on every shape"). Where it does, blocks run op by op
        and only their switch is compiled (`LayerSteps`), which rounds as stock does. Asked of every block
        at its own first pass of one position (`CompileVerdict.check`), before it runs compiled: whether a
        fused kernel rounds otherwise depends on the values it rounds, each layer's weights and inputs its
        own, so one layer's answer does not stand for another's. None where the block cannot be traced (it
        waits for an array)."""
        call = self._traced(as_routed)
        try:
            compiled = mx.compile(call)(x, self.stack)[0]
        except ValueError:  # MLX refuses a trace that evaluates an array
            self.traceable = False
            return None
        return bool(mx.array_equal(call(x, self.stack)[0], compiled).item())

    def _traced(self, lanes: Callable) -> Callable:
        """The block's pass for `mx.compile` to trace: the switch inside takes its rows through `lanes`
        (`Trace`) and does no booking; the routed ids and the lanes' outputs come out with the output."""

        def call(x, state):
            trace = Trace(lanes, state)
            y = self._within(trace, lambda: self.inner(x))
            return y, trace.indices, trace.outputs

        return call


class Trace:
    """What a compiled block's switch computes with while it is traced (`CompiledBlock._traced`): its MLX
    work alone, the routed ids and the lanes' outputs handed out of the compiled call."""

    def __init__(self, lanes: Callable, state: tuple):
        self.lanes, self.state = lanes, state
        self.indices = self.outputs = None

    def switch(self, steps: LayerSteps, x: mx.array, indices: mx.array) -> mx.array:
        self.indices = indices
        y, self.outputs = steps.run(self.lanes, x, (indices, *self.state))
        return y
