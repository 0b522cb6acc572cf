"""Backend-specific choices, kept in one place: compute dtype and memory queries.

MLX runs on Metal (macOS), CUDA and the CPU. They differ in what is fast and what they can report:
- On the CPU backend `GatherMM` (unquantized experts) supports float32 only, and float32 scales make the
  quantized kernels several times faster than bfloat16, so floating weights are cast to float32 there.
  On GPUs the checkpoint's dtype is kept.
- On a GPU a host sync idles the device, so optimistic decode passes are on there (`per_layer/optimistic.py`).
- Metal reports a recommended working-set size; on Linux the OS reports available memory. On CUDA the
  device's own memory is a second budget: the driver reports what is free on the card (`device_memory`),
  and what this process holds (`memory_in_use`).
- On the CPU and on Metal (unified memory) an array's memory is host memory: expert bytes are written
  into the cache's stacked arrays through a numpy view, with no MLX op. On CUDA the runtime copies them
  there (`cuda.DeviceCopies`: `cudaMemcpyAsync` from pinned staging into the managed memory MLX computes
  on), also with no MLX op; where that is unavailable, the cache falls back to MLX slice updates, from
  arrays the reader threads make.
- Two-tier mode (`two_tier/two_tier_runtime.py`) keeps every expert in host memory for the GPU to read in
  place where the GPU has memory of its own (CUDA) and the host holds the experts (`two_tier_choice`);
  `map_for_device` advises such a stack (`cuda.HostMapping`). On the CPU and Metal the same code runs on plain
  memory. MLX counts a mapped stack as active memory against its memory limit (on CUDA 0.95 of the device's
  memory), so the limit is raised by the bytes kept in host memory (`map_for_device`, `unmap`).
- That fallback's arrays are managed memory made from host bytes, which migrates page by page on first
  touch: `stage_for_device` asks the driver to keep such an array's pages in host memory, mapped for the
  GPU, so neither side faults. The advice stays with the memory when MLX recycles the buffer, so only
  buffers od-moe keeps are advised, and `unstage` takes the advice back before they go: a recycled
  host-preferred buffer under the slots or activations of a later engine slowed its decode (docs/GPU.md,
  "The per-layer path on CUDA").
- On CUDA attention runs on MLX's own kernels, not cuDNN's (`MLX_CUDA_USE_CUDNN_SDPA=0` unless the user
  set it): cuDNN builds a graph for every new prompt shape, which costs many times a short prefill
  (`attention_choice`).
- On Linux MLX's backend is a package of its own (mlx-cpu, mlx-cuda-12, mlx-cuda-13: od-moe's extras cpu,
  cuda12, cuda13). Where importing MLX fails for want of one that runs here, importing od-moe (this module
  is the first to import MLX) says in one line which to install (`missing_backend`): an ImportError, or
  `od-moe: error: ...` and exit code 2 in the `od-moe` command.
Nothing else in od-moe asks which backend it is on.
"""

import contextlib
import ctypes
import os
import sys
from importlib import metadata

import numpy as np

BACKEND_PACKAGES = {"cpu": "mlx-cpu", "cuda12": "mlx-cuda-12", "cuda13": "mlx-cuda-13"}  # extra -> package


def cuda_driver_version() -> int | None:
    """The CUDA version of the NVIDIA driver (13000 for 13.0, the one `nvidia-smi` shows) where it sees a
    GPU, else None. Asks the driver itself (libcuda), which needs no CUDA toolkit and no MLX."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, version = ctypes.c_int(), ctypes.c_int()
    if driver.cuInit(0) or driver.cuDeviceGetCount(ctypes.byref(count)) or count.value < 1:
        return None
    return None if driver.cuDriverGetVersion(ctypes.byref(version)) else version.value


def extra_for_this_machine() -> tuple[str, str]:
    """od-moe's extra whose MLX backend runs here, and why: cuda13 or cuda12 by the NVIDIA driver's CUDA
    version (MLX builds for no older one), else cpu."""
    version = cuda_driver_version()
    if version is None:
        return "cpu", "no NVIDIA GPU found; on one, [cuda13] or [cuda12] by the CUDA version nvidia-smi shows"
    cuda = f"CUDA {version // 1000}.{version % 1000 // 10}"
    if version < 12000:
        return "cpu", f"the NVIDIA driver's {cuda} is older than any MLX CUDA backend needs"
    return ("cuda13" if version >= 13000 else "cuda12"), f"an NVIDIA GPU, the driver's {cuda}"


def missing_backend(error: ImportError) -> str | None:
    """What to do, in one line, where `import mlx.core` failed with `error` for want of a backend that runs
    here; None where it failed for another reason. The failures, as MLX 0.32.4 on Linux gives them:
    plain `mlx` alone: "libmlx.so: cannot open shared object file" (mlx-cpu and mlx-cuda-* each ship it);
    mlx-cuda-* where no NVIDIA driver is installed: "libcuda.so.1: cannot open shared object file"."""
    installed = [name for name in BACKEND_PACKAGES.values() if _installed(name)]
    if "libmlx.so" in str(error):
        if installed:  # another backend's uninstall took the file they share
            return (
                f"MLX's libmlx.so is missing though {installed[0]} is installed: pip install "
                f"--force-reinstall --no-deps '{installed[0]}=={_installed(installed[0])}'"
            )
        extra, why = extra_for_this_machine()
        return f"MLX has no backend installed: pip install 'od-moe[{extra}]' ({why})"
    cuda = [name for name in installed if name.startswith("mlx-cuda")]
    if "libcuda.so" in str(error) and cuda:
        return (
            f"MLX's CUDA backend ({cuda[0]}) needs an NVIDIA driver, and this machine has none: "
            f"pip uninstall -y {cuda[0]} && pip install 'od-moe[cpu]'"
        )
    return None


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _is_the_command() -> bool:
    """Whether this process is the `od-moe` command: its script, or `python -m od_moe` (sys.argv[0] is "-m"
    while runpy imports the package, before od_moe/__main__.py runs)."""
    argv = getattr(sys, "orig_argv", [])
    module = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"), None)
    return os.path.basename(sys.argv[0] if sys.argv else "") == "od-moe" or (
        sys.argv[:1] == ["-m"] and module in ("od_moe", "od_moe.__main__")
    )


try:
    import mlx.core as mx
except ImportError as e:
    advice = missing_backend(e)
    if advice is None:
        raise
    if _is_the_command():  # the package is imported before cli.main runs: its one line is said from here
        print(f"od-moe: error: {advice}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(advice) from e

from . import cuda  # noqa: E402 (after MLX's import, which may stop here)

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"


def attention_choice() -> str | None:
    """On CUDA, prefill attention by MLX's own kernels unless the environment asks for cuDNN's: cuDNN
    builds a graph for each new (batch, prompt length) on first use, which costs many times the prefill
    itself, and a server meets new shapes with nearly every request, so requests arriving together wait
    far longer for their first tokens with cuDNN (docs/GPU.md, "Time to first token"). Long prompts are
    prefilled in chunks, which bounds the scores MLX's kernels hold. MLX reads the setting at its first
    attention on the GPU, so it is made when od-moe is imported. Returns the setting made, or None."""
    if CUDNN_ATTENTION in os.environ or not mx.cuda.is_available():
        return None
    os.environ[CUDNN_ATTENTION] = "0"
    return "0"


attention_choice()


def is_cpu_backend() -> bool:
    """True when MLX computes on the CPU (no Metal, no CUDA)."""
    return mx.default_device().type == mx.cpu


def syncs_stall_device() -> bool:
    """True where a host round trip leaves the device idle until the host launches more work (GPUs), so
    fewer syncs beat computing a pass twice now and then (optimistic decode passes); on the CPU backend
    the host and the device share the same cores and the second passes cost more than the syncs."""
    return not is_cpu_backend()


def compute_dtype(requested: str = "auto") -> mx.Dtype | None:
    """The floating dtype weights are cast to, or None to keep the checkpoint's.

    requested: "auto" (float32 on the CPU backend, the checkpoint's dtype elsewhere), "model" (never
    cast), or a dtype name such as "float32", "float16", "bfloat16".
    """
    if requested == "model":
        return None
    if requested == "auto":
        return mx.float32 if is_cpu_backend() else None
    try:
        dtype = getattr(mx, requested)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        from ..errors import UserError

        raise UserError(f"unknown dtype {requested!r}: use auto, model, float32, float16 or bfloat16")
    return dtype


def cast_floating(array: mx.array, dtype: mx.Dtype | None) -> mx.array:
    """Cast a floating array to `dtype` (None: unchanged); integer (packed) arrays are left alone."""
    if dtype is None or not mx.issubdtype(array.dtype, mx.floating) or array.dtype == dtype:
        return array
    return array.astype(dtype)


def arrays_in_host_memory() -> bool:
    """True where MLX arrays live in memory the host writes directly (the CPU; Metal's unified memory).
    On CUDA they are device memory: bytes get there by MLX copies, best prepared off the generation
    thread (`Reader(make_arrays=True)`)."""
    return not (mx.default_device().type == mx.gpu and not mx.metal.is_available())


def stack_zeros_on(past_host_memory: bool, cpu_stream):
    """Where a mapped stack is made (its zeros written: the first touch of its memory): `cpu_stream` where
    arrays are host memory, or where the host holds every expert (CPU streams write them fastest,
    docs/GPU.md, "Time to first token"); on CUDA past the host's memory (a bounded host tier) the device, so
    that the slot rows, held on the device afterwards, never take host memory. Made on the host they did,
    every layer's at once, before their advice moved them: more than the host's budget
    (`two_tier/mapped.py`). The host rows move to the host as the host writes them."""
    return cpu_stream if arrays_in_host_memory() or not past_host_memory else mx.gpu


def sends_between_ranks() -> bool:
    """Whether `mx.distributed.send`/`recv` run on this device: not on CUDA (MLX 0.32: "Send has no CUDA
    implementation"), where a pipeline hands hidden states over with a collective instead
    (`distributed/rank_split.py`). OD_MOE_SEAMS=collective asks for the collective anywhere (to test it on the
    CPU)."""
    if os.environ.get("OD_MOE_SEAMS") == "collective":
        return False
    return not (mx.cuda.is_available() and mx.default_device().type == mx.gpu)


_host_preferred_hints = cuda.HostPreferredHints()
_copies = cuda.DeviceCopies()
_host_mapping = cuda.HostMapping()
# of the memory available, what the mapped stacks of two-tier mode may take before "auto" declines it
TWO_TIER_HOST_FRACTION = 0.8


def two_tier_choice(requested, expert_nbytes: int, host_bytes: int | None = None) -> tuple[bool, str]:
    """Whether an engine runs in two-tier mode, and why, for `requested` ("auto", True or False) and a
    model whose experts take `expert_nbytes` in memory. "auto": on where the GPU has memory of its own
    (CUDA), so that a miss read in place from host memory beats a host round trip, and the host holds the
    experts; off on the CPU and Metal, where host memory is the only memory and misses come from disk.
    `host_bytes`: the host's budget (`--memory-budget` on CUDA) in place of what the OS says is available."""
    if host_bytes is None:
        available = available_memory_bytes()
        fits = expert_nbytes <= available * TWO_TIER_HOST_FRACTION
        where = f"experts {expert_nbytes / 1e9:.2f} GB, host memory available {available / 1e9:.2f} GB"
    else:
        fits = expert_nbytes <= host_bytes
        where = f"experts {expert_nbytes / 1e9:.2f} GB, host memory budget {host_bytes / 1e9:.2f} GB"
    if requested is True:
        return True, f"two-tier mode forced on ({where})"
    if requested is False:
        return False, "two-tier mode off (asked)"
    if not (mx.cuda.is_available() and mx.default_device().type == mx.gpu):
        return (
            False,
            "two-tier mode off: not a CUDA device, whose memory is its own",
        )
    if not fits:
        return False, f"two-tier mode off: host memory cannot hold the experts ({where})"
    return True, f"two-tier mode: every expert mapped from host memory, misses read in place ({where})"


def host_room(host_bytes: int | None = None, held: int = 0) -> int:
    """Bytes of host memory the experts may take in host memory for the device to read: `host_bytes` (the
    host's budget) less `held`, what the process holds in host memory besides them, where a budget is given;
    else `TWO_TIER_HOST_FRACTION` of what the OS says is available (which the process's memory is not)."""
    if host_bytes is not None:
        return max(0, host_bytes - held)
    return int(available_memory_bytes() * TWO_TIER_HOST_FRACTION)


def resident_bytes() -> int:
    """The process's resident set now (0 where the OS does not say)."""
    return _resident_bytes() or 0


def map_for_device(array: mx.array, device_tail: int) -> bool:
    """Keep `array` (made from host bytes) in host memory for the GPU to read in place, its last
    `device_tail` bytes in device memory (`cuda.HostMapping`); nothing to do where arrays are host memory.
    True where advice was given."""
    if arrays_in_host_memory():
        return False
    _hold_in_host(cuda.address_of(array), array.nbytes - device_tail)
    return _host_mapping.apply(array, device_tail)


def unmap(array: mx.array):
    """Undo `map_for_device` before `array` is let go."""
    if not arrays_in_host_memory():
        unmap_at(cuda.address_of(array))


def unmap_at(address: int):
    """Undo `map_for_device` for an array MLX has let go of, by the address it had."""
    if not arrays_in_host_memory():
        _host_mapping.release_at(address)
        _hold_in_host(address, 0)


_held_in_host: dict[int, int] = {}  # address of a mapped array -> its bytes kept in host memory


def limit_device_memory(budget: int):
    """Where the device has memory of its own, MLX's memory limit at the device `budget` (plus the mapped
    host bytes it counts as its own, `_hold_in_host`): past it MLX gives back its cache of freed buffers
    before it allocates more. Its own limit is a share of the card's whole memory, blind to what other
    processes hold, so on a card shared with another process a long prompt's prefill ran out of memory with
    MLX's limit as it was (docs/GPU.md, "A card smaller than the model")."""
    if not arrays_in_host_memory():
        mx.set_memory_limit(budget + sum(_held_in_host.values()))


def release_cached_memory():
    """Where the device's memory is its own (CUDA), give MLX's cache of freed buffers back to the driver:
    called when the engine goes idle, so that between requests the card holds what the process keeps (other
    processes share the card); elsewhere MLX keeps its cache (the OS reclaims host memory as it needs)."""
    if not arrays_in_host_memory():
        mx.clear_cache()
        cuda.trim_memory_pool()


def _hold_in_host(address: int, nbytes: int):
    """Keep MLX's memory limit a bound on device memory: raised by the bytes of mapped arrays kept in host
    memory (0: one let go). MLX counts them as active memory, and past its limit it waits for the GPU
    after every operation and empties its buffer cache at every allocation, which slows decode by a large
    share and which a model larger than the GPU's memory meets from the first token (`docs/GPU.md`, "MLX's
    memory limit")."""
    change = nbytes - _held_in_host.pop(address, 0)
    if nbytes:
        _held_in_host[address] = nbytes
    if change:
        mx.set_memory_limit(max(0, mx.get_memory_limit() + change))


@contextlib.contextmanager
def host_arrays_ahead(nbytes: int):
    """MLX's limit raised by `nbytes` while host arrays are made that `map_for_device` counts only later:
    made all at once they would put MLX past its limit, where it waits for its running work before it
    starts more (`mlx/transforms.cpp`), one array at a time. Held as `_hold_in_host` holds a mapped array."""
    key = -id(alive := object())  # no array's address (`alive` keeps it unique until the end)
    _hold_in_host(key, 0 if arrays_in_host_memory() else max(0, nbytes))
    try:
        yield alive
    finally:
        _hold_in_host(key, 0)


def stage_for_device(array: mx.array) -> mx.array:
    """`array`, made from host bytes to be copied into device memory, kept where neither the host's
    writes nor the device's read of it migrate pages (CUDA managed memory); unchanged elsewhere. For
    arrays the caller keeps and writes again: `unstage` each before letting it go.
    Without the hint pages migrate on first touch from each side, so making and installing a large expert
    takes several times longer (docs/BENCHMARKS.md, "Investigations", `installs.py`)."""
    if arrays_in_host_memory():
        return array
    return _host_preferred_hints.apply(array)


def unstage(array: mx.array):
    """Undo `stage_for_device` for an array that is no longer needed, so that MLX recycles its buffer as
    any other (call it once nothing still computing reads the array)."""
    if not arrays_in_host_memory():
        _host_preferred_hints.release(array)


def copies_into_arrays() -> bool:
    """True where bytes read into host memory go into the cache's arrays with no MLX operation: written
    through numpy views (CPU, Metal), or copied by the CUDA runtime (`cuda.DeviceCopies`) while that works.
    Elsewhere installs are MLX writes from arrays the reader threads make (`Reader(make_arrays=True)`)."""
    return arrays_in_host_memory() or (_copies.available() and _copies.trusted is not False)


def row_writer(array: mx.array) -> np.ndarray | cuda.RowWriter | None:
    """What writes rows of an evaluated, row-contiguous array from host bytes (`writer[i] = row`, rows as
    unsigned integers of the array's item size, so bfloat16 works too): a numpy view of its memory where
    that is host memory, a `cuda.RowWriter` on CUDA, else None.

    Writes change the array behind MLX's back: the caller must make sure no pending computation reads the
    rows it writes (`mx.synchronize()` first), and call `rows_written()` after a batch of writes.
    """
    if not arrays_in_host_memory():
        return _copies.writer(array) if copies_into_arrays() else None
    return cuda.writable_view(array)


def rows_written(check: tuple[mx.array, int, np.ndarray] | None = None) -> bool:
    """After a batch of `row_writer` writes: on CUDA, issue the copies and wait for them, so that MLX work
    launched from now on reads their bytes. `check` (array, row, the bytes written there): until one such
    check has passed, the row is read back through MLX, and a mismatch (memory the device does not see at
    that address) turns the copies off for good. Returns False where the rows must be written again through
    MLX (the copies failed or were not seen)."""
    if arrays_in_host_memory():
        return True
    try:
        _copies.flush()
    except cuda.CopyError:
        return False
    if check is not None and _copies.trusted is None:
        array, row, written = check
        seen = np.array(array[row].reshape(-1).view(mx.uint8))
        _copies.checked(bool(np.array_equal(seen, written.reshape(-1).view(np.uint8))))
    return _copies.trusted is not False


def available_memory_bytes() -> int:
    """Memory od-moe may plan to use: Metal's recommended working set on macOS, else what the OS says
    is available (Linux MemAvailable), else physical memory."""
    if sys.platform == "darwin" and mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_card_at_start: list = []  # [(card bytes in use, this process's context bytes)] at the first device query
# A CUDA context where NVML cannot say what this process's takes: 0.54 GB measured in every process with
# MLX 0.32.4 and mlx-cuda-13 (docs/GPU.md, "A card smaller than the model").
CUDA_CONTEXT_NBYTES = 540_000_000


def device_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the device MLX computes on where that memory is its own (CUDA), as the
    driver counts them (what other processes hold is not free); None where arrays are host memory (the CPU,
    Metal's unified memory), whose budget `available_memory_bytes` gives. The first call (`load` makes it
    before allocating) is the baseline `memory_in_use` counts from."""
    if arrays_in_host_memory():
        return None
    card = cuda.memory_info()
    if card is not None and not _card_at_start:
        _card_at_start.append((card[1] - card[0], cuda.process_device_bytes(os.getpid()) or 0))
    return card


def context_bytes() -> int:
    """This process's CUDA context on the card, as the driver counted it at the first `device_memory`
    call (`CUDA_CONTEXT_NBYTES` where it could not); 0 where arrays are host memory."""
    if device_memory() is None or not _card_at_start:
        return 0
    return _card_at_start[0][1] or CUDA_CONTEXT_NBYTES


def memory_in_use() -> dict:
    """This process's memory as the driver and the OS count it, device and host apart: `device_bytes`
    (CUDA: the card's memory in use now less what was in use at the first `device_memory` call, plus this
    process's CUDA context then; the driver's per-process count leaves out managed memory, where MLX
    keeps the slots, so the card's count is the one nvidia-smi agrees with, and it moves with other
    processes' use too; None where arrays are host memory), `host_bytes` (resident set size, Linux; None
    elsewhere) and `host_peak_bytes` (the most it has been, every OS)."""
    device = None
    if not arrays_in_host_memory() and (card := device_memory()) is not None:
        used_then, context = _card_at_start[0]
        device = card[1] - card[0] - used_then + context
    host = _resident_bytes()
    return {
        "device_bytes": device,
        "host_bytes": host,
        "host_peak_bytes": max(_peak_resident_bytes(), host or 0),  # the OS updates its peak lazily
    }


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_resident_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux kilobytes


def peak_memory_bytes() -> int:
    """Peak memory held by MLX arrays since the last reset (all backends track this)."""
    return int(mx.get_peak_memory())


def reset_peak_memory() -> None:
    mx.reset_peak_memory()


def active_memory_bytes() -> int:
    return int(mx.get_active_memory())
