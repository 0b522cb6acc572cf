"""Backend-specific choices, kept in one place: compute dtype and memory queries.

MLX runs on Metal (macOS), CUDA and the CPU. They differ in what is fast and what they can report:
- On the CPU backend `GatherMM` (unquantized experts) supports float32 only, and float32 scales make the
  quantized kernels several times faster than bfloat16, so floating weights are cast to float32 there.
  On GPUs the checkpoint's dtype is kept.
- On a GPU a host sync idles the device, so optimistic decode passes are on there (`optimistic.py`).
- Metal reports a recommended working-set size; on Linux the OS reports available memory.
- On the CPU and on Metal (unified memory) an array's memory is host memory: expert bytes are written
  into the cache's stacked arrays through a numpy view, with no MLX op. CUDA memory is not written that
  way; the cache falls back to MLX slice updates there, from arrays the reader threads make.
- On CUDA an array made from host bytes is managed memory, which migrates page by page on first touch:
  the GPU's read of it, and the host's next write into the recycled buffer, each fault. `stage_for_device`
  asks the driver to keep such an array's pages in host memory, mapped for the GPU, so neither side faults
  (the one call to the CUDA runtime od-moe makes, through ctypes; MLX does the same for its small pool).
  The advice stays with the memory when MLX recycles the buffer, so only buffers od-moe keeps are advised,
  and `unstage` takes the advice back before they go: a recycled host-preferred buffer under the
  slots or activations of a later engine slowed its decode (H100, widened x128 at 25%).
Nothing else in od-moe asks which backend it is on.
"""

import ctypes
import os
import sys
import threading

import mlx.core as mx
import numpy as np

_UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


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
        from .errors import UserError

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


class _ManagedStaging:
    """CUDA managed-memory hints for host-made arrays that the GPU reads once (expert bytes on their way
    into the cache): preferred location the host, accessed by the device. Each buffer is advised once, and
    its advice taken back (`release`) before MLX may recycle it: the advice stays with the memory. An
    error turns the hints off for good, leaving the arrays as MLX made them."""

    MIN_BYTES = 256 * 1024  # the bundled model's 20 KB experts gained nothing: per-operation latency
    PREFERRED_LOCATION, ACCESSED_BY = 3, 5  # cudaMemoryAdvise (each one more: unset)
    HOST, DEVICE = 2, 1  # cudaMemLocationType

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    def __init__(self, runtime=None, version: int = 13000, device: int = 0):
        self.device = device  # MLX computes on the first GPU
        self.on = None  # None: the runtime not looked for yet
        self.advised: dict[int, int] = {}  # buffer address -> bytes advised
        self.lock = threading.Lock()
        if runtime is not None:
            self._use(runtime, version)

    def _use(self, runtime, version: int):
        """CUDA 13 takes a location where CUDA 12 took a device number (the host: cudaCpuDeviceId, -1)."""
        if version >= 13000:
            self.host, self.gpu = self.Location(self.HOST, 0), self.Location(self.DEVICE, self.device)
        else:
            self.host, self.gpu = -1, self.device
        runtime.cudaMemAdvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, type(self.gpu)]
        self.runtime, self.on = runtime, True

    def _find_runtime(self):
        """The CUDA runtime MLX loaded into this process."""
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
            runtime = ctypes.CDLL(path or "libcudart.so.13")
            version = ctypes.c_int()
            if runtime.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
                raise OSError("no CUDA runtime version")
        except OSError:
            self.on = False
            return
        self._use(runtime, version.value)

    def apply(self, array: mx.array) -> mx.array:
        if self.on is False or array.nbytes < self.MIN_BYTES:
            return array
        address = np.array(array, copy=False).__array_interface__["data"][0]  # made from host bytes: no copy
        with self.lock:
            if self.on is None:
                self._find_runtime()
            if not self.on or self.advised.get(address, 0) >= array.nbytes:
                return array
            for advice, where in ((self.PREFERRED_LOCATION, self.host), (self.ACCESSED_BY, self.gpu)):
                if self.runtime.cudaMemAdvise(address, array.nbytes, advice, where) != 0:
                    # not managed memory (MLX's pinned fallback) or an old driver: leave it to MLX, and
                    # clear the error, which MLX would otherwise find after its next kernel launch
                    self.runtime.cudaGetLastError()
                    self.on = False
                    return array
            self.advised[address] = array.nbytes
        return array

    def release(self, array: mx.array):
        """Take back the advice given to `array`'s buffer (before MLX may recycle it)."""
        if not self.on or array.nbytes < self.MIN_BYTES:
            return
        address = np.array(array, copy=False).__array_interface__["data"][0]
        with self.lock:
            nbytes = self.advised.pop(address, 0)
            if not nbytes:
                return
            for advice, where in ((self.PREFERRED_LOCATION + 1, self.host), (self.ACCESSED_BY + 1, self.gpu)):
                if self.runtime.cudaMemAdvise(address, nbytes, advice, where) != 0:
                    self.runtime.cudaGetLastError()


_managed_staging = _ManagedStaging()


def stage_for_device(array: mx.array) -> mx.array:
    """`array`, made from host bytes to be copied into device memory, kept where neither the host's
    writes nor the device's read of it migrate pages (CUDA managed memory); unchanged elsewhere. For
    arrays the caller keeps and writes again: `unstage` each before letting it go.
    On the H100 (MLX 0.32.4), `benchmarks/installs.py`: a 2.65 MB expert made from read bytes and copied
    into a cache slot took 1,089 + 1,422 us as MLX leaves it and 284 + 534 us with the hint."""
    if arrays_in_host_memory():
        return array
    return _managed_staging.apply(array)


def unstage(array: mx.array):
    """Undo `stage_for_device` for an array that is no longer needed, so that MLX recycles its buffer as
    any other (call it once nothing still computing reads the array)."""
    if not arrays_in_host_memory():
        _managed_staging.release(array)


def host_view(array: mx.array) -> np.ndarray | None:
    """A writable numpy view of an evaluated, row-contiguous array's memory, as unsigned integers of the
    same item size (so bfloat16 works too), or None where the memory cannot be written from the host.

    Writes through the view change the array behind MLX's back: the caller must make sure no pending
    computation reads the rows it writes (`mx.synchronize()` first).
    """
    if not arrays_in_host_memory():
        return None
    bits = _UINT_OF_SIZE.get(array.dtype.size)
    if bits is None:
        return None
    raw = array if array.dtype == bits else array.view(bits)  # shares the buffer
    mx.eval(raw)
    try:
        view = np.array(raw, copy=False)
    except (TypeError, ValueError, RuntimeError):
        return None
    return (
        view
        if view.flags.writeable and view.flags.c_contiguous and view.shape == tuple(array.shape)
        else None
    )


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


def peak_memory_bytes() -> int:
    """Peak memory held by MLX arrays since the last reset (all backends track this)."""
    return int(mx.get_peak_memory())


def reset_peak_memory() -> None:
    mx.reset_peak_memory()


def active_memory_bytes() -> int:
    return int(mx.get_active_memory())
