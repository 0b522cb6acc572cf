"""The CUDA runtime calls od-moe makes itself, through ctypes, beside MLX's CUDA backend.

MLX's CUDA arrays are managed memory: one address the host and the device both use. Two things MLX's own
API does slowly for expert bytes read from disk, done here with the runtime MLX already loaded:
- `DeviceCopies`: host bytes copied straight into rows of an evaluated MLX array (a cache slot) with
  `cudaMemcpyAsync`, no MLX operation at all, from staging registered as pinned memory: a copy from pinned
  memory runs at the bus's rate with no MLX graph around it, where an MLX slice update first makes or maps
  an array (docs/BENCHMARKS.md, "Investigations", `copy_installs`). The copies run on the legacy
  default stream; `flush` issues and waits for them, so MLX work launched after it reads the new bytes,
  and the caller makes sure, as for host writes on the CPU, that no computation in flight reads the rows
  being written. Off by default (`Loader.copy_installs`): see there what it measured.
- `HostPreferredHints`: memory advice for host-made arrays the device reads once (`backend.stage_for_device`),
  used where copies are unavailable (the fallback install path through MLX arrays).
Any error turns the feature off for good and clears the runtime's error state (MLX checks it after its
launches); callers then fall back to MLX operations. Not here: which backend is running (`memory/backend.py`).
"""

import ctypes
import threading
import weakref

import mlx.core as mx
import numpy as np

_UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
HOST_TO_DEVICE = 1  # cudaMemcpyKind
_lock = threading.Lock()
_runtime: list = []  # [(runtime, version)] once looked for; [None] where none was found


def find_runtime():
    """The CUDA runtime MLX loaded into this process and its version, or None."""
    with _lock:
        if not _runtime:
            try:
                with open("/proc/self/maps") as maps:
                    path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
                runtime = ctypes.CDLL(path or "libcudart.so.13")
                version = ctypes.c_int()
                if runtime.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
                    raise OSError("no CUDA runtime version")
                _runtime.append((runtime, version.value))
            except OSError:
                _runtime.append(None)
        return _runtime[0]


def numpy_view(array: mx.array) -> np.ndarray | None:
    """An array's memory as a numpy array of unsigned integers of its item size (so bfloat16 works too),
    evaluated first; None where MLX gives no such view. No copy: writes through it change the array."""
    bits = _UINT_OF_SIZE.get(array.dtype.size)
    if bits is None:
        return None
    raw = array if array.dtype == bits else array.view(bits)  # shares the buffer
    mx.eval(raw)
    try:
        return np.array(raw, copy=False)
    except (TypeError, ValueError, RuntimeError):
        return None


def writable_view(array: mx.array) -> np.ndarray | None:
    """`numpy_view(array)` where writes through it land row by row in the array's own memory (writable,
    C-contiguous, the array's shape), else None."""
    view = numpy_view(array)
    if (
        view is None
        or not (view.flags.writeable and view.flags.c_contiguous)
        or view.shape != tuple(array.shape)
    ):
        return None
    return view


def address_of(array: mx.array) -> int:
    """Where an array's memory starts. MLX's CUDA arrays are managed memory, so this is the address the
    device uses too."""
    view = numpy_view(array)
    if view is None:
        raise CopyError(f"no view of a {array.dtype} array's memory")
    return view.__array_interface__["data"][0]


class CopyError(RuntimeError):
    """A CUDA copy call failed: copies are off from now on, and the caller writes through MLX instead."""


class RowWriter:
    """Rows of one evaluated MLX array, written from host bytes by `DeviceCopies` (`writer[i] = row`, as a
    numpy view is written on backends whose arrays are host memory); the copies start at `flush`."""

    def __init__(self, copies: "DeviceCopies", array: mx.array):
        self.copies = copies
        self.address = address_of(array)
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(f"uint{8 * array.dtype.size}")
        self.row_nbytes = array.nbytes // array.shape[0]

    def __setitem__(self, index: int, row: np.ndarray):
        if row.nbytes != self.row_nbytes or not row.flags.c_contiguous:
            raise ValueError(f"a row of {self.row_nbytes} contiguous bytes, not {row.nbytes}")
        if not 0 <= index < self.shape[0]:
            raise IndexError(index)
        self.copies.queue(self.address + index * self.row_nbytes, row)


class DeviceCopies:
    """Host-to-device copies into MLX arrays: queued row by row and issued at `flush`, their host buffers
    pinned on first use. One call per row, so small experts pay a call's fixed cost per array (an install of
    the bundled model's 20 KB experts is nine copies; docs/BENCHMARKS.md, "Investigations"):
    `cudaMemcpyBatchAsync` as CUDA 13 declares it returned an error."""

    def __init__(self, runtime=None):
        self.on = None if runtime is None else True  # None: the runtime not looked for yet
        self.runtime = runtime
        self.queued: list[tuple[int, np.ndarray]] = []  # (destination address, host row) not issued yet
        self.pinned: set[int] = set()  # addresses of the host buffers registered
        # None until a copy was read back through MLX (`backend.rows_written`); False: the device did not
        # see it (the address the buffer protocol gave is not the memory MLX computes on), copies off
        self.trusted = None
        if runtime is not None:
            self._declare()

    def available(self) -> bool:
        if self.on is None:
            found = find_runtime()
            self.on = found is not None
            if found is not None:
                self.runtime = found[0]
                self._declare()
        return self.on

    def checked(self, seen: bool):
        """A copy was read back through MLX (`backend.rows_written`): whether the device saw its bytes (not:
        copies off for good)."""
        self.trusted = seen

    def _declare(self):
        runtime, pointer, size = self.runtime, ctypes.c_void_p, ctypes.c_size_t
        runtime.cudaMemcpyAsync.argtypes = [pointer, pointer, size, ctypes.c_int, pointer]
        runtime.cudaStreamSynchronize.argtypes = [pointer]
        runtime.cudaHostRegister.argtypes = [pointer, size, ctypes.c_uint]
        runtime.cudaHostUnregister.argtypes = [pointer]

    def writer(self, array: mx.array) -> RowWriter | None:
        """A writer of `array`'s rows, or None where copies are unavailable (or MLX gives no view of the
        array's memory)."""
        if not self.available():
            return None
        try:
            return RowWriter(self, array)
        except CopyError:
            return None

    def queue(self, address: int, row: np.ndarray):
        if not self.on:
            raise CopyError("CUDA copies are off")
        self.queued.append((address, row))

    def flush(self):
        """Issue the copies queued and wait for them: MLX work launched after this reads their bytes, and
        their host buffers may be written again. On an error nothing queued stays queued."""
        queued, self.queued = self.queued, []
        if not queued:
            return
        for _, row in queued:
            self._pin(row)
        for address, row in queued:
            code = self.runtime.cudaMemcpyAsync(address, row.ctypes.data, row.nbytes, HOST_TO_DEVICE, None)
            if code != 0:
                self._failed("cudaMemcpyAsync", code)
        code = self.runtime.cudaStreamSynchronize(None)
        if code != 0:
            self._failed("cudaStreamSynchronize", code)

    def _failed(self, call: str, code: int):
        self.runtime.cudaStreamSynchronize(None)  # no copy still lands after the caller's MLX writes
        self.runtime.cudaGetLastError()
        self.on = False
        raise CopyError(f"{call} returned CUDA error {code}")

    def _pin(self, row: np.ndarray):
        """Register the host buffer a row lies in as pinned memory while it lives (copies from it then run
        at the bus's speed; from pageable memory the driver stages them through a buffer of its own):
        staging is allocated once and reused, so this happens once per buffer. A failure leaves it
        pageable."""
        buffer = row
        while isinstance(buffer.base, np.ndarray):
            buffer = buffer.base
        address = buffer.ctypes.data
        if address in self.pinned or not buffer.flags.owndata:
            return
        if self.runtime.cudaHostRegister(address, buffer.nbytes, 0) != 0:
            self.runtime.cudaGetLastError()
            return
        self.pinned.add(address)
        weakref.finalize(buffer, self._unpin, address)

    def _unpin(self, address: int):
        self.pinned.discard(address)
        self.runtime.cudaHostUnregister(address)


class HostPreferredHints:
    """CUDA managed-memory hints for host-made arrays that the GPU reads once (expert bytes on their way
    into the cache): preferred location the host, accessed by the device. Each buffer is advised once, and
    its advice taken back (`release`) before MLX may recycle it: the advice stays with the memory. An
    error turns the hints off for good, leaving the arrays as MLX made them."""

    # the bundled model's 20 KB experts gain nothing: per-operation latency, not bytes, bounds them, and
    # advising them too was slower (docs/BENCHMARKS.md, "Investigations", `installs.py`)
    MIN_BYTES = 256 * 1024
    PREFERRED_LOCATION, ACCESSED_BY = 3, 5  # cudaMemoryAdvise (each one more: unset)
    HOST, DEVICE = 2, 1  # cudaMemLocationType

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    # the host and the GPU as `cudaMemAdvise` takes them: a location (CUDA 13) or a device number (CUDA 12)
    host: "HostPreferredHints.Location | int"
    gpu: "HostPreferredHints.Location | int"

    def __init__(self, runtime=None, version: int = 13000, device: int = 0):
        self.device = device  # MLX computes on the first GPU
        self.on: bool | None = None  # None: the runtime not looked for yet
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

    def apply(self, array: mx.array) -> mx.array:
        if self.on is False or array.nbytes < self.MIN_BYTES:
            return array
        address = address_of(array)
        with self.lock:
            if self.on is None:
                found = find_runtime()
                if found is None:
                    self.on = False
                else:
                    self._use(*found)
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
        if not self.on:
            return
        address = address_of(array)
        with self.lock:
            nbytes = self.advised.pop(address, 0)
            if not nbytes:
                return
            for advice, where in ((self.PREFERRED_LOCATION + 1, self.host), (self.ACCESSED_BY + 1, self.gpu)):
                if self.runtime.cudaMemAdvise(address, nbytes, advice, where) != 0:
                    self.runtime.cudaGetLastError()


class HostMapping:
    """CUDA managed-memory advice for an expert stack that stays in host memory and that the GPU reads in
    place (two-tier mode, `two_tier/two_tier_runtime.py`): preferred location the host and accessed by the
    device over the whole array, so `gather_qmm` reads the rows it needs over PCIe with no page migration; its
    last `device_tail` bytes (the layer's slots) preferred on the device and moved there, so that a hit reads
    device memory (a slot left on the host is read over PCIe like a miss, so hits would save nothing:
    docs/GPU.md, "One computation per lane"). `release_at` takes
    the advice back before MLX may recycle the buffer. An error turns the advice off for good and clears the
    runtime's error state; the arrays then stay as MLX made them (still exact, read as MLX places them)."""

    def __init__(self, device: int = 0):
        self.device = device
        self.on: bool | None = None  # None: the runtime not looked for yet
        self.advised: dict[int, int] = {}  # buffer address -> bytes advised
        self.lock = threading.Lock()

    def _ready(self) -> bool:
        if self.on is None:
            found = find_runtime()
            self.on = found is not None
            if found is not None:
                runtime, version = found
                hints = HostPreferredHints(runtime, version, self.device)
                self.runtime, self.host, self.gpu = runtime, hints.host, hints.gpu
                where = type(self.gpu)
                if version >= 13000:  # CUDA 13 takes a location and flags where CUDA 12 took a device
                    runtime.cudaMemPrefetchAsync.argtypes = [
                        ctypes.c_void_p, ctypes.c_size_t, where, ctypes.c_uint, ctypes.c_void_p
                    ]  # fmt: skip
                    self._prefetch = lambda a, n: runtime.cudaMemPrefetchAsync(a, n, self.gpu, 0, None)
                else:
                    runtime.cudaMemPrefetchAsync.argtypes = [
                        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
                    ]  # fmt: skip
                    self._prefetch = lambda a, n: runtime.cudaMemPrefetchAsync(a, n, self.gpu, None)
                runtime.cudaDeviceSynchronize.argtypes = []
        return self.on

    def apply(self, array: mx.array, device_tail: int) -> bool:
        """Advise `array` (evaluated, made from host bytes) as above; True if the advice took."""
        with self.lock:
            if not self._ready():
                return False
            address, nbytes = address_of(array), array.nbytes
            steps = [
                lambda: self.runtime.cudaMemAdvise(
                    address, nbytes, HostPreferredHints.PREFERRED_LOCATION, self.host
                ),
                lambda: self.runtime.cudaMemAdvise(address, nbytes, HostPreferredHints.ACCESSED_BY, self.gpu),
            ]
            if device_tail:
                tail = address + nbytes - device_tail
                steps += [
                    lambda: self.runtime.cudaMemAdvise(
                        tail, device_tail, HostPreferredHints.PREFERRED_LOCATION, self.gpu
                    ),
                    lambda: self._prefetch(tail, device_tail),
                    lambda: self.runtime.cudaDeviceSynchronize(),
                ]
            self.advised[address] = nbytes
            for step in steps:
                if step() != 0:
                    self.runtime.cudaGetLastError()
                    self.on = False
                    self.advised.pop(address, None)
                    return False
            return True

    def release_at(self, address: int):
        """Take back the advice given to the buffer at `address` (before MLX may recycle it, or after)."""
        with self.lock:
            if not self.on:
                return
            nbytes = self.advised.pop(address, 0)
            for advice, where in (
                (HostPreferredHints.PREFERRED_LOCATION + 1, self.host),
                (HostPreferredHints.ACCESSED_BY + 1, self.gpu),
            ):
                if nbytes and self.runtime.cudaMemAdvise(address, nbytes, advice, where) != 0:
                    self.runtime.cudaGetLastError()


def memory_info() -> tuple[int, int] | None:
    """The current device's (free, total) bytes as the CUDA runtime counts them (memory other processes
    hold is not free), or None without a runtime. Makes the primary context if none exists yet."""
    found = find_runtime()
    if found is None:
        return None
    runtime = found[0]
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
        runtime.cudaGetLastError()
        return None
    return free.value, total.value


def trim_memory_pool() -> bool:
    """Wait for the device, then give the current device's stream-ordered memory pool's unused memory
    back to the driver. MLX frees device buffers with cudaFreeAsync into that pool, which keeps them until
    a synchronize: just after `mx.clear_cache()` the card still counted about 1.5 GB more than MLX holds
    (docs/GPU.md, "A card smaller than the model"). False where the runtime cannot."""
    found = find_runtime()
    if found is None:
        return False
    runtime, device, pool = found[0], ctypes.c_int(), ctypes.c_void_p()
    if (
        runtime.cudaDeviceSynchronize() != 0
        or runtime.cudaGetDevice(ctypes.byref(device)) != 0
        or runtime.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), device) != 0
        or runtime.cudaMemPoolTrimTo(pool, ctypes.c_size_t(0)) != 0
    ):
        runtime.cudaGetLastError()
        return False
    return True


class _NvmlProcess(ctypes.Structure):  # nvmlProcessInfo_t (the v2/v3 layout)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("used", ctypes.c_ulonglong),
        ("gpu_instance", ctypes.c_uint),
        ("compute_instance", ctypes.c_uint),
    ]


_NVML_NOT_AVAILABLE = 2**64 - 1
_nvml: list = []  # [library] once initialised; [None] where NVML cannot be used


def _nvml_library():
    with _lock:
        if not _nvml:
            try:
                nvml = ctypes.CDLL("libnvidia-ml.so.1")
                _nvml.append(nvml if nvml.nvmlInit_v2() == 0 else None)
            except (OSError, AttributeError):
                _nvml.append(None)
        return _nvml[0]


def process_device_bytes(pid: int) -> int | None:
    """Device memory the driver counts for process `pid` over every GPU (what nvidia-smi lists for it: its
    CUDA context and device allocations, but not managed memory, which MLX's slots are, as
    `lab/device_memory/measure.py` found with MLX 0.32.4), or None where NVML cannot say: no driver library,
    or no process of that id (a container sees other ids than the driver)."""
    nvml = _nvml_library()
    if nvml is None:
        return None
    count = ctypes.c_uint()
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return None
    total, found = 0, False
    for index in range(count.value):
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            continue
        size = ctypes.c_uint(256)
        processes = (_NvmlProcess * size.value)()
        if nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(size), processes) != 0:
            continue
        for process in processes[: size.value]:
            if process.pid == pid and process.used != _NVML_NOT_AVAILABLE:
                total, found = total + process.used, True
    return total if found else None
