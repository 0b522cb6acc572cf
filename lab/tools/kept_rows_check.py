"""The device-kept rows' CUDA kernel against its numpy twin, and its time a call, on a device.

    python3 lab/tools/kept_rows_check.py check [STEPS]
    python3 lab/tools/kept_rows_check.py time [CALLS]

`check`: two `KeptRows` over copies of the same random stacks, one deciding on the device (the kernel), one
on the host (`kept_rows.plan` through numpy views, as the CPU runs it), given the same calls: demand calls
of 1-64 routed lanes (repeats, padding, experts in slots), predictions (`expect`: top-P of scores), by
recency and by decayed counts. After every call the tables, each lane's row and hit, the rows held, their
ages, counts, copies and hit lanes must be equal, and at the end each row must hold the bytes of the expert
it names.
`time`: the kernel's wall time a call at the Qwen3-30B-A3B shape's rows (three 786,432-byte weight arrays
and six 49,152-byte scale and bias arrays an expert, 128 experts, 32 rows), over CALLS chained demand calls
of 8 lanes built, then evaluated at once (the evaluation's wall time: their launches and kernels): every
lane held (nothing copied), then one expert not held a call.

Not a test (CI has no GPU); what it printed for a commit goes into docs/GPU.md ("Device-kept rows").
"""

import sys
import time

import mlx.core as mx
import numpy as np

from od_moe.two_tier import kept_rows, tally


def stacks(E: int, rows: int, sizes: list[int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            ("p", f"a{i}"): mx.array(rng.integers(0, 255, (E + rows, n), dtype=np.uint8))
            for i, n in enumerate(sizes)
        }
    ]


def twins(E: int, C: int, S: int, P: int, decay):
    device = kept_rows.KeptRows(stacks(E, C + S, [4096, 256], 0), E, [C], S, P)
    host = kept_rows.KeptRows(stacks(E, C + S, [4096, 256], 0), E, [C], S, P)
    host.on_device = False
    host.counts = tally.RunningCounts(len(host.stacks), device=False)  # made on the device by __init__
    for rows in (device, host):
        rows.decay = decay
    assert device.on_device, "needs MLX on CUDA"
    return device, host


def state(rows: kept_rows.KeptRows) -> tuple[np.ndarray, ...]:
    """Layer 0's rows held, their ages and the counts, wherever `rows` keeps them."""
    if rows.on_device:
        return tuple(np.array(a[0]) for a in (rows.held, rows.age, rows.score))
    return rows._held_host[0], rows._age_host[0], rows._score_host[0]


def check(steps: int):
    rng = np.random.default_rng(1)
    failures = 0
    for decay in (None, 0.9):
        E, C, S, P = 128, 4, 32, 4
        device, host = twins(E, C, S, P, decay)
        base = np.arange(E)
        base[rng.choice(E, C, replace=False)] = E + np.arange(C)  # C experts in slots
        base_mx = mx.array(base.astype(np.uint32))
        popular = rng.permutation(E)[:48]  # routing leans on a few experts, so rows are hit and evicted
        for step in range(steps):
            ahead = rng.random() < 0.2
            if ahead:
                cand = mx.array(rng.standard_normal(E).astype(np.float32))
            else:
                n = int(rng.choice([1, 2, 8, 8, 8, 16, 40, 64]))
                ids = np.where(rng.random(n) < 0.8, rng.choice(popular, n), rng.integers(0, E, n))
                cand = kept_rows.padded(mx.array(ids.astype(np.uint32)), E)
            outs = [rows._call(0, cand, base_mx, ahead) for rows in (device, host)]
            names = ("found", "rows", "lane_rows", "lane_hit")[: 2 if ahead else 4]
            bad = [k for k, a, b in zip(names, *outs) if not np.array_equal(np.array(a), np.array(b))]
            for name, a, b in zip(("held", "age", "score"), state(device), state(host)):
                if not np.array_equal(a, b):
                    bad.append(name)
            (copied, hits), (host_copied, host_hits) = device.read(), host.read()
            if not np.array_equal(copied, host_copied):
                bad.append(f"copies {copied[0]} != {host_copied[0]}")
            if not np.array_equal(hits, host_hits):
                bad.append(f"hit lanes {hits[0]} != {host_hits[0]}")
            if bad:
                failures += 1
                print(f"decay {decay} step {step} ({'ahead' if ahead else 'demand'}): differ in {bad}")
        wrong = kept_rows.wrong_rows(device)
        failures += bool(wrong)
        print(f"decay {decay}: {steps} calls, rows holding other bytes than they name: {wrong}")
    print("kernel equals plan" if not failures else f"{failures} calls differ")
    return failures


def time_calls(calls: int):
    E, S = 128, 32
    sizes = [786432] * 3 + [49152] * 6
    rows = kept_rows.KeptRows(stacks(E, S, sizes, 2), E, [0], S, 8)
    base = mx.arange(E, dtype=mx.uint32)
    held = mx.arange(8, dtype=mx.uint32)
    rows._call(0, held, base, False)  # rows 0-7 hold experts 0-7; compiles
    mx.eval(rows.held)
    for label, cand in (
        ("every lane held", lambda i: held),
        ("one expert not held", lambda i: mx.concatenate([held[:7], mx.array([8 + i % 100], mx.uint32)])),
    ):
        inputs = [cand(i) for i in range(calls)]
        mx.eval(inputs)
        for _ in range(2):  # the second is the figure: the first may compile
            mx.synchronize()
            t0 = time.perf_counter()
            for c in inputs:
                rows._call(0, c, base, False)
            t1 = time.perf_counter()
            mx.eval(rows.held, rows.age)
            t2 = time.perf_counter()
        rows.read()
        built, ran = (t1 - t0) / calls * 1e6, (t2 - t1) / calls * 1e6
        print(f"{label}: {ran:.1f} us a call evaluated, {built:.1f} us a call built, over {calls} calls")
    print(f"rows holding other bytes than they name: {kept_rows.wrong_rows(rows)}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "check":
        raise SystemExit(1 if check(int(rest[0]) if rest else 400) else 0)
    time_calls(int(rest[0]) if rest else 200)
