"""How fast a decoded token's staged copies cross the bus on CUDA: the widened copy with no experts in slots
(`tt:0`, every decode pass staged, `two_tier/staged_passes.py`), its eight MoE layers' lanes copied from the
mapped stacks by `kernels.staged_lanes` and by candidate kernels, in the same process as the token they serve.

Per kernel: the eight layers' copies (8 lanes of 2.65 MB each) evaluated together with no order between
them ("together": the bus's best), and chained so that each layer's copy waits for the one before
("chained": as a decoded token runs them, one layer after the other), best of `REPEATS`, ms and GB/s.
First, ms a decoded token of stock and of the engine (mlx-lm's loop, the bench's 3 prompts x 48 tokens,
median of 3 rounds, texts compared); then the kernels' rates; then both again with every stack moved to
device memory (the same operations with no bytes on the bus). The candidates: one grid striding over
every (lane, array) unit, each thread `ilp` loads in flight before its stores.

    python3 lab/tools/copy_rate_probe.py [WORKDIR]

CUDA only (the kernels are `mx.fast.cuda_kernel`s). Not a test and not a bench row: a measurement for
docs/GPU.md, "The 0% row's floor".
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
from kernel_time import decode, stacks_to_device  # a tool beside this one

import od_moe
from od_moe.bench.widen import widen_model
from od_moe.two_tier import kernels as two_tier_kernels
from od_moe.two_tier.bus_probe import best_seconds

REPEATS = 20
LANES = 8

# every (lane, array) unit in one index space, each thread `ILP` loads in flight before its stores
_FLAT = """
    using U = {unit};
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t base = (size_t)blockIdx.x * blockDim.x + threadIdx.x; base < {total}; base += step * {ilp}) {{
        U v[{ilp}];
        U* to[{ilp}];
        #pragma unroll
        for (int j = 0; j < {ilp}; ++j) {{
            size_t g = base + (size_t)j * step;
            to[j] = nullptr;
            if (g >= {total}) continue;
{picks}
        }}
        #pragma unroll
        for (int j = 0; j < {ilp}; ++j) if (to[j]) *to[j] = v[j];
    }}
"""
_PICK = """            {els}if (g < {end}) {{
                size_t r = (g - {start}) / {units}, u = (g - {start}) % {units};
                v[j] = reinterpret_cast<const U*>(a{i})[(size_t)table[(uint32_t)indices[r]] * {units} + u];
                to[j] = reinterpret_cast<U*>(o{i}) + (g - {start});
            }}"""
_flat_kernels: dict = {}


def flat_lanes(indices, table, arrays, blocks: int, ilp: int):
    """Lane i's expert copied into row i of a copy of each array, by one grid striding over every unit."""
    unit, units = two_tier_kernels.row_units(arrays)
    k = indices.size
    key = (unit, units, k, ilp)
    if key not in _flat_kernels:
        picks, start = [], 0
        for i, n in enumerate(units):
            end = start + k * n
            picks.append(_PICK.format(els="else " if i else "", end=end, start=start, units=n, i=i))
            start = end
        _flat_kernels[key] = mx.fast.cuda_kernel(
            name=f"probe_flat_{len(_flat_kernels)}",
            input_names=["indices", "table", *(f"a{i}" for i in range(len(units)))],
            output_names=[f"o{i}" for i in range(len(units))],
            source=_FLAT.format(unit=unit, total=start, ilp=ilp, picks="\n".join(picks)),
        )
    return _flat_kernels[key](
        inputs=[indices.reshape(-1), table, *arrays],
        grid=(blocks * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(k, *a.shape[1:]) for a in arrays],
        output_dtypes=[a.dtype for a in arrays],
    )


def layers_copied(copy, stacks, table, lanes, chained: bool):
    out, link = [], None
    for stack, ids in zip(stacks, lanes):
        if chained and link is not None:
            ids = ids + (link * 0).astype(ids.dtype)
        copies = copy(ids, table, list(stack.values()))
        link = copies[0].reshape(-1)[:1]
        out.extend(copies)
    return out


def main():
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/odb")
    path = widen_model(od_moe.DEFAULT_MODEL, workdir / "widened-x128", 128)
    engine = od_moe.load(str(path), capacity=0.0, two_tier=True)
    stacks = [s for s in engine.runtime.stacks if s]
    E = engine.runtime.num_experts
    table = mx.arange(E, dtype=mx.int32)
    mx.random.seed(0)
    lanes = [mx.random.permutation(E)[:LANES].astype(mx.uint32).reshape(1, 1, LANES) for _ in stacks]
    expert = sum(a.nbytes // a.shape[0] for a in stacks[0].values())
    total = len(stacks) * LANES * expert
    print(f"{len(stacks)} layers x {LANES} lanes x {expert / 1e6:.2f} MB = {total / 1e6:.1f} MB a token")
    kernels = {"staged_lanes blocks=32": lambda i, t, a: two_tier_kernels.staged_lanes(i, t, a, 32)[0]}
    for blocks, ilp in ((264, 4), (1056, 1)):
        kernels[f"flat blocks={blocks} ilp={ilp}"] = lambda i, t, a, b=blocks, p=ilp: flat_lanes(
            i, t, a, b, p
        )
    stock, tokenizer = mlx_lm.load(str(path))
    stock_texts, stock_ms = decode(lambda p, n: mlx_lm.stream_generate(stock, tokenizer, p, max_tokens=n))
    texts, mapped_ms = decode(lambda p, n: engine.stream_generate(p, max_tokens=n))
    print(
        f"stock: {stock_ms:.3f} ms a decoded token; tt:0 mapped: {mapped_ms:.3f}; same {texts == stock_texts}"
    )
    rates(kernels, stacks, table, lanes, total)
    stacks_to_device(engine)
    texts, device_ms = decode(lambda p, n: engine.stream_generate(p, max_tokens=n))
    print(f"tt:0, stacks in device memory: {device_ms:.3f} ms a decoded token; same {texts == stock_texts}")
    rates(kernels, stacks, table, lanes, total)


def rates(kernels, stacks, table, lanes, total):
    reference = [mx.take(a, lanes[0].reshape(-1).astype(mx.int32), axis=0) for a in stacks[0].values()]
    print("kernel | together ms | GB/s | chained ms | GB/s | equal")
    for name, copy in kernels.items():
        got = copy(lanes[0], table, list(stacks[0].values()))
        equal = all(mx.array_equal(g, r).item() for g, r in zip(got, reference))
        found = []
        for chained in (False, True):
            ms = 1e3 * best_seconds(
                lambda c=chained, k=copy: layers_copied(k, stacks, table, lanes, c), REPEATS
            )
            found += [f"{ms:.3f}", f"{total / ms / 1e6:.1f}"]
        print(f"{name} | {' | '.join(found)} | {equal}", flush=True)


if __name__ == "__main__":
    main()
