"""The two-tier path's copy kernels' logic off the GPU: `kernels.staged_lanes` (a decode pass's lanes),
`kernels.copy_rows` (a staged pass's copy) and `slot_fill.KernelFills.fill` (slot fills), launched by their
own code with their CUDA source compiled for the CPU (`cuda_emulation.cuda_kernel`), against numpy's row
copies. Each is also run with a realistic bug put into its source, which the same comparison catches. What
the emulation does not show (NVRTC's compile, threads racing, timing) is said in `cuda_emulation.py`; the
kept rows' kernel is tested in `test_kept_rows.py`."""

import shutil

import cuda_emulation
import mlx.core as mx
import numpy as np
import pytest

from od_moe.two_tier import kernels, slot_fill

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None,
    reason="the CUDA kernels' emulation compiles with g++ (Debian: apt-get install g++); .ci/run installs it",
)

E, S = 16, 4  # experts, then the rows past them (slots, E + slot)
# rows of 16-byte loads, one longer than two blocks of 256 threads (a block's loop runs twice) ...
WIDE = [((40, 24), mx.uint32), ((40, 3), mx.bfloat16), ((9600,), mx.uint8)]
# ... and rows of 2 bytes at a time (a float16 row of 6 bytes in the stack)
NARROW = [((6,), mx.uint32), ((3,), mx.float16)]


@pytest.fixture
def emulated(monkeypatch):
    """The two-tier code's kernels launched on the CPU, none kept from an earlier test."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_emulation.cuda_kernel)
    monkeypatch.setattr(kernels, "_kernels", {})


def _stack(shapes, seed) -> list[mx.array]:
    """Arrays of E + S rows of random bytes, rows of these shapes and dtypes."""
    rng = np.random.default_rng(seed)
    arrays = []
    for shape, dtype in shapes:
        raw = rng.integers(0, 256, (E + S, *shape[:-1], shape[-1] * dtype.size), dtype=np.uint8)
        arrays.append(mx.array(raw).view(dtype))
    mx.eval(arrays)
    return arrays


def _bytes(array: mx.array) -> np.ndarray:
    return np.array(array.view(mx.uint8))


def _lanes_differences(shapes) -> list[str]:
    """`staged_lanes` for a decode pass's 8 lanes (three experts in slots, one in slot 0: row E) against
    numpy: each lane's row copied from where the table says, its hit, the pass's counts."""
    arrays = _stack(shapes, seed=0)
    table = np.arange(E, dtype=np.uint32)
    table[[2, 5, 11]] = E + np.array([0, 3, 1])
    indices = np.array([[[5, 0, 2, 9, 11, 15, 7, 3]]], np.uint32)
    copies, hit, counts = kernels.staged_lanes(mx.array(indices), mx.array(table), arrays, blocks=2)
    rows = table[indices.reshape(-1)]
    held = int((rows >= E).sum())
    found = [
        f"array {i}'s rows"
        for i, (a, c) in enumerate(zip(arrays, copies))
        if not np.array_equal(np.take(_bytes(a), rows, axis=0), _bytes(c))
    ]
    if np.array(hit).tolist() != (rows >= E).reshape(indices.shape).tolist():
        found.append("hits")
    if np.array(counts).tolist() != [8, held, 1, 8 - held]:
        found.append("counts")
    return found


def _rows_differences(shapes) -> list[str]:
    """`copy_rows` of 10 rows of which the first 7 are needed (host rows, slots, a row twice) against numpy:
    those 7 copied, the 3 after them left unwritten."""
    arrays = _stack(shapes, seed=1)
    sources = np.array([19, 3, 3, 0, 16, 8, E - 1, E, E, E], np.int32)
    count = 7
    copies = kernels.copy_rows(arrays, mx.array(sources), mx.array(count), sources.size, blocks=2)
    found = []
    for i, (a, c) in enumerate(zip(arrays, copies)):
        got = _bytes(c)
        if not np.array_equal(np.take(_bytes(a), sources[:count], axis=0), got[:count]):
            found.append(f"array {i}'s rows")
        if not (got[count:] == cuda_emulation.SENTINEL).all():
            found.append(f"array {i}'s unneeded rows written")
    return found


def _fill_differences(shapes) -> list[str]:
    """`KernelFills.fill` of 3 moves (host row -> slot row) against numpy: those rows copied within each
    array of the stack and nothing else changed, a pair in `moves` past the count never run."""
    stack = {("p", f"a{i}"): a for i, a in enumerate(_stack(shapes, seed=2))}
    expected = [_bytes(a) for a in stack.values()]
    pairs = [(3, E + 0), (9, E + 2), (E - 1, E + 3)]
    for a in expected:
        for source, slot in pairs:
            a[slot] = a[source]
    moves = [i for pair in pairs for i in pair] + [0, E + 1]
    done = slot_fill.KernelFills().fill(stack, mx.array(moves, mx.int32), len(pairs), mx.zeros((1, 4)))
    found = [
        f"array {i}'s rows"
        for i, (a, want) in enumerate(zip(stack.values(), expected))
        if not np.array_equal(_bytes(a), want)
    ]
    return found + ([] if done.item() == len(stack) else ["done"])


CHECKS = {"staged_lanes": _lanes_differences, "copy_rows": _rows_differences, "slot_fill": _fill_differences}


@pytest.mark.parametrize("shapes", [WIDE, NARROW], ids=["16-byte", "2-byte"])
@pytest.mark.parametrize("kernel", list(CHECKS))
def test_a_copy_kernel_emulated_copies_as_numpy(emulated, kernel, shapes):
    assert CHECKS[kernel](shapes) == []


# a realistic bug for each kernel: (its source's name in `kernels`, the text, the text with the bug)
BUGS = {
    "staged_lanes": ("_LANES", "from >= {E}", "from > {E}"),  # slot 0's lanes not hits
    "copy_rows": ("_ROWS", "if (row >= (uint32_t)count[0])", "if (row + 1 >= (uint32_t)count[0])"),
    "slot_fill": ("_SLOT_FILL", "i = (size_t)blockIdx.x * blockDim.x + threadIdx.x", "i = threadIdx.x"),
    "the copy loop": ("_CASE", "u < {units}", "u + 1 < {units}"),  # each row's last load dropped
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_the_comparison_catches_a_kernel_with_a_bug(emulated, monkeypatch, bug):
    """The same comparisons fail on each kernel's source with an off-by-one or a dimension of the grid
    ignored (the text is checked to be there, so a rewritten kernel needs its bug rewritten too)."""
    name, text, wrong = BUGS[bug]
    source = getattr(kernels, name)
    assert text in source
    monkeypatch.setattr(kernels, name, source.replace(text, wrong))
    for kernel in [bug] if bug in CHECKS else ["staged_lanes", "copy_rows"]:
        assert CHECKS[kernel](WIDE) != [], kernel
