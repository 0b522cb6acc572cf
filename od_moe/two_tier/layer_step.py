"""What two-tier mode puts into the model (`TwoTierSwitch` for each switch, `CompiledBlock` for each MoE block
that has one), and how a layer computes on the rows a pass gives its lanes (`Lanes`): mlx-lm's switch on
those rows (`LayerSteps`), or mlx-lm's whole MoE block around it (router, top-k, the switch, the weighted
sum), as one compiled MLX call for a pass of one position.

A decoded token on a fast GPU waits on the host (docs/GPU.md, "Where a decoded token's time goes"): at
every pass Python makes each MLX operation of a layer's router, its lookups and mlx-lm's switch
(`SwitchGLU`: three `gather_qmm`s and the activation). `mx.compile` traces a call once per input shapes and
MLX replays it with none of that Python. The operations are the same ones on the same bytes, so the tokens
are stock mlx-lm's (the suite compares them). Only one position's passes are compiled: their shapes repeat
at every decoded token, while a prompt's would trace anew for each length.

Each layer's pass is `TwoTierRuntime.layer_pass`, entered once: by the block where its pass is one compiled
call (routing inside it), else by the switch mlx-lm's block calls (routed). What the call takes besides the
hidden state (the tables, the stack's arrays, the rows' state) are `Lanes.inputs`, and what it gives besides
the output (the routed ids, hit lanes, counts, the rows' state) comes out of it as outputs: a traced call
writes nothing, and the runtime books what it gave. Not here: which rows the lanes read this pass and what
is booked (`two_tier_runtime.py`, `kept_rows.py`, `staged_passes.py`).
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..model_surgery.switch_over import switch_on


@dataclass(frozen=True)
class Lanes:
    """How a layer pass's routed lanes find their rows: `read(indices, *inputs)` -> (the arrays to compute
    on, in the stack's order; the row each lane reads in them; the pass's other outputs by name, for the
    runtime to book: "hit" lanes, "staged" counts, device-kept "rows" state). `traced`: `read` may be
    traced by `mx.compile` (MLX operations alone); else it runs as it is, op by op (it waits for the host)."""

    key: tuple  # names `read` and everything it closes over (a compiled call's key)
    read: Callable
    inputs: tuple = ()  # the arrays `read` takes besides the routed ids
    traced: bool = True


def as_routed(indices: mx.array, *arrays):
    """Lanes that read the rows they are routed to: every expert in its own row (its host row, or every
    slot in expert order)."""
    return arrays, indices, {}


def within_stack(indices: mx.array, *arrays):
    """`as_routed` where the stack may hold fewer rows than the experts (a bounded host tier): an expert
    past its rows reads the row its id wraps to. For checks that compare two ways of computing the same
    rows (`CompiledBlock.compiles_exactly`), never for a pass's output."""
    return arrays, indices % arrays[0].shape[0], {}


def through_table(indices: mx.array, table: mx.array, *arrays):
    """Lanes that read the row the table gives their expert (E + its slot where it is in one, else its host
    row); the other output: which lanes are hits (a row past the experts' own)."""
    read = table[indices]
    return arrays, read, {"hit": read >= table.shape[0]}


def all_in_slots(indices: mx.array, table: mx.array, *arrays):
    """`through_table` where every expert is in a slot: every lane a hit, so none is counted on the device."""
    return arrays, table[indices], {}


class LayerSteps:
    """mlx-lm's switch of one layer, copied so that it holds none of the stack's arrays between calls, and
    its calls compiled on lanes (`on_lanes`)."""

    def __init__(self, stacked: nn.Module, keys):
        self.keys = list(keys)  # the stack's (projection, array name), in the order arrays are given
        self.switch = switch_on(stacked, dict.fromkeys(self.keys))
        # for traces: the products' batch indices constants of the compiled call
        self.traced_switch = switch_on(stacked, dict.fromkeys(self.keys), rows_given=True)
        self._compiled: dict = {}

    def compute(self, arrays, x: mx.array, rows: mx.array, traced: bool = False) -> mx.array:
        """`switch(x, rows)` on `arrays` (in `keys`' order), set for this call only: afterwards the switch
        keeps none of them alive. traced: the products' batch indices given (`switch_on`'s rows_given), for
        a trace."""
        switch = self.traced_switch if traced else self.switch
        for (proj, name), array in zip(self.keys, arrays):
            switch[proj][name] = array
        try:
            return switch(x, rows)
        finally:
            for proj, name in self.keys:
                switch[proj][name] = None

    def on_lanes(self, lanes: Lanes, x: mx.array, indices: mx.array) -> tuple[mx.array, dict]:
        """(the switch's output for `x` and the routed `indices`, the lanes' other outputs): each lane's row
        by `lanes`, then the products on those rows. One compiled call (traced once per `lanes.key`) where
        the pass is of one position and the lanes can be traced, else op by op."""
        if lanes.traced and indices.size == indices.shape[-1]:
            if lanes.key not in self._compiled:
                self._compiled[lanes.key] = mx.compile(_Traced(self, lanes.read))
            return self._compiled[lanes.key](x, (indices, *lanes.inputs))
        arrays, rows, outputs = lanes.read(indices, *lanes.inputs)
        return self.compute(arrays, x, rows), outputs


class _Traced:
    """The switch on lanes as `mx.compile` traces it: `read` on the routed ids and inputs, then the products
    with their batch indices given."""

    def __init__(self, steps: LayerSteps, read: Callable):
        self.steps, self.read = steps, read

    def __call__(self, x: mx.array, inputs: tuple) -> tuple[mx.array, dict]:
        arrays, rows, outputs = self.read(*inputs)
        return self.steps.compute(arrays, x, rows, traced=True), outputs


class TwoTierSwitch(nn.Module):
    """Drop-in `switch_mlp`: the layer's pass, routed by mlx-lm's block around it (`layer_pass`), on mlx-lm's
    switch over the layer's stack (`stacked`: experts, then slots)."""

    def __init__(self, stacked: nn.Module, runtime, layer: int):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "stacked", stacked)  # not a child: the stack is no parameter of the model
        object.__setattr__(self, "runtime", runtime)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.runtime.layer_pass(self.layer, x, indices=indices)


class LanesSwitch:
    """The switch of one call of a block's copy (`CompiledBlock.on_lanes`): each lane's row by `read(indices,
    *inputs)`, then mlx-lm's switch on those rows; the routed ids and the lanes' outputs noted in `seen`,
    the caller's own list."""

    def __init__(self, steps: LayerSteps, read: Callable, inputs: tuple, seen: list, traced: bool):
        self.steps, self.read, self.inputs, self.seen, self.traced = steps, read, inputs, seen, traced

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        arrays, rows, outputs = self.read(indices, *self.inputs)
        self.seen.append((indices, outputs))
        return self.steps.compute(arrays, x, rows, traced=self.traced)


def with_switch(module: nn.Module, switch) -> nn.Module:
    """A copy of `module` with `switch` where its `TwoTierSwitch` is: the modules on the way there copied
    (shallow), so nothing of `module`'s own changes."""
    path = next(name for name, m in module.named_modules() if isinstance(m, TwoTierSwitch)).split(".")
    return _replaced(module, path, switch)


def _replaced(module: nn.Module, path: list[str], switch) -> nn.Module:
    clone = copy.copy(module)
    clone[path[0]] = switch if len(path) == 1 else _replaced(module[path[0]], path[1:], switch)
    return clone


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
    """mlx-lm's MoE block (`inner`) in two-tier mode: a pass of one position is the layer's pass
    (`layer_pass`) as one compiled call of the whole block (`on_lanes`) where that is exact (`verdict`,
    shared by the model's blocks: one that is not sends all op by op) and the runtime's lanes can be traced
    (`runtime.compiles_blocks`); any other call is `inner` itself, its `TwoTierSwitch` the layer's pass.
    `stack`: the layer's stack arrays, experts first in expert order."""

    def __init__(
        self, inner: nn.Module, runtime, layer: int, steps: LayerSteps, stack: tuple, verdict: CompileVerdict
    ):
        super().__init__()
        self.inner = inner
        self.layer = layer
        object.__setattr__(self, "runtime", runtime)  # not a child
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "_compiled", {})
        object.__setattr__(self, "stack", stack)  # not parameters of the model
        object.__setattr__(self, "verdict", verdict)
        self.traceable = True  # False once the block proved not traceable (it waits for an array)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        one = x.size == x.shape[-1] and not (args or kwargs) and self.traceable
        if one and self.runtime.compiles_blocks:
            self.verdict.check(self, x)
            if self.traceable and self.verdict.exact:
                return self.runtime.layer_pass(self.layer, x, block=self)
        return self.inner(x, *args, **kwargs)

    def on_lanes(self, lanes: Lanes, x: mx.array) -> tuple[mx.array, mx.array, dict]:
        """(the block's output for `x`, the routed ids, the lanes' other outputs), its switch reading each
        lane's row by `lanes`: one compiled call (traced once per `lanes.key`), or op by op once MLX refused
        to trace the block (its code waits for an array)."""
        if self.traceable and lanes.traced:
            if lanes.key not in self._compiled:
                self._compiled[lanes.key] = mx.compile(self._on(lanes.read))
            try:
                return self._compiled[lanes.key](x, lanes.inputs)
            except ValueError:  # MLX refuses a trace that evaluates an array: the block runs as it is
                self.traceable = False
        return self._on(lanes.read, traced=False)(x, lanes.inputs)

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
        call = self._on(within_stack)  # rows past a bounded stack's would be read out of it (CUDA faults)
        try:
            compiled = mx.compile(call)(x, self.stack)[0]
        except ValueError:  # MLX refuses a trace that evaluates an array
            self.traceable = False
            return None
        return bool(mx.array_equal(call(x, self.stack)[0], compiled).item())

    def _on(self, read: Callable, traced: bool = True) -> Callable:
        """The block's call (x, inputs) -> (output, routed ids, the lanes' other outputs) on a copy of
        `inner` whose switch reads each lane's row by `read(indices, *inputs)` (`LanesSwitch`): what
        `mx.compile` traces (`traced`: the products' batch indices given), with no side effect."""

        def call(x: mx.array, inputs: tuple):
            seen: list = []
            y = with_switch(self.inner, LanesSwitch(self.steps, read, inputs, seen, traced))(x)
            ((indices, outputs),) = seen
            return y, indices, outputs

        return call
