"""The device-kept rows' CUDA kernel against its numpy twin, and its time a call, on a device.

    python3 lab/tools/kept_rows_check.py check [STEPS]
    python3 lab/tools/kept_rows_check.py time [CALLS]

`check`: two `KeptRows` over copies of the same random stacks, one deciding on the device (the kernel), one
on the host (`kept_rows.plan` through numpy views, as the CPU runs it), given the same calls: demand calls
of 1-64 routed lanes (repeats, padding, experts in slots), predictions (`expect`: top-P of scores), by
recency and by decayed counts. After every call the tables, each lane's row and hit, the rows held, their
ages, counts, copies and hit lanes must be equal, and at the end both stacks' bytes: the suite's comparison
(`differences` in `tests/cuda_emulation.py`, where the kernel is emulated on the CPU), here on the device.
`time`: the kernel's wall time a call at the Qwen3-30B-A3B shape's rows (three 786,432-byte weight arrays
and six 49,152-byte scale and bias arrays an expert, 128 experts, 32 rows), over CALLS chained demand calls
of 8 lanes built, then evaluated at once (the evaluation's wall time: their launches and kernels): every
lane held (nothing copied), then one expert not held a call; each as the eager path calls it (with tables)
and as a fused decode pass does (`KeptRows.fused_lanes`: no tables).

Not a test (CI has no GPU); what it printed for a commit goes into docs/GPU.md ("Device-kept rows").
"""

import sys
import time
from pathlib import Path

import mlx.core as mx

from od_moe.two_tier import kept_rows
from od_moe.two_tier.settings import KeptRowsSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from cuda_emulation import differences, stacks  # noqa: E402  (the suite's twin comparison)


def check(steps: int) -> int:
    """`cuda_emulation.differences` with the CUDA kernel deciding, by recency and by decayed counts."""
    failures = 0
    for decay in (None, 0.9):
        found = differences(steps, 128, 4, 32, 4, [4096, 256], seed=1, decay=decay, deciding=on_device)
        failures += len(found)
        for line in found:
            print(line)
        print(f"decay {decay}: {steps} calls, {len(found)} differences")
    print("kernel equals plan" if not failures else f"{failures} differences")
    return failures


def on_device(*args) -> kept_rows.KeptRows:
    rows = kept_rows.KeptRows(*args)
    assert rows.on_device, "needs MLX on CUDA"
    return rows


def time_calls(calls: int):
    E, S = 128, 32
    sizes = [786432] * 3 + [49152] * 6
    rows = kept_rows.KeptRows(stacks(E, S, sizes, 2), E, [0], S, KeptRowsSettings(predicted=8))
    base = mx.arange(E, dtype=mx.uint32)
    held = mx.arange(8, dtype=mx.uint32)
    rows._call(0, held, base, False)  # rows 0-7 hold experts 0-7; compiles
    mx.eval(rows.held)

    def fused(c):  # as a decode pass calls it (`KeptRows.fused_lanes`): lanes' rows, no tables
        lanes = rows.fused_lanes(0, base)
        rows.keep(0, lanes.read(c, *lanes.inputs)[2]["rows"])

    for label, cand in (
        ("every lane held", lambda i: held),
        ("one expert not held", lambda i: mx.concatenate([held[:7], mx.array([8 + i % 100], mx.uint32)])),
    ):
        inputs = [cand(i) for i in range(calls)]
        mx.eval(inputs)
        for how, call in (("tables", lambda c: rows._call(0, c, base, False)), ("fused", fused)):
            for _ in range(2):  # the second is the figure: the first may compile
                mx.synchronize()
                t0 = time.perf_counter()
                for c in inputs:
                    call(c)
                t1 = time.perf_counter()
                mx.eval(rows.held, rows.age)
                t2 = time.perf_counter()
            rows.read()
            built, ran = (t1 - t0) / calls * 1e6, (t2 - t1) / calls * 1e6
            print(f"{label}, {how}: {ran:.1f} us a call evaluated, {built:.1f} us built, over {calls} calls")
    print(f"rows holding other bytes than they name: {kept_rows.wrong_rows(rows)}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "check":
        raise SystemExit(1 if check(int(rest[0]) if rest else 400) else 0)
    time_calls(int(rest[0]) if rest else 200)
