"""Expert store: where every expert's bytes live on disk, and reading them with `preadv`.

The safetensors headers of a model folder (one file, or shards listed by an index JSON) are parsed once.
For each MoE block the store builds a `BlockLayout` (`storage/layout.py`): for every array an expert owns
(gate/up/down weight, and scales/biases when quantized) the file, offset and length of each expert's
slice. Two layouts:
- MLX: stacked `(E, ...)` tensors (`...switch_mlp.gate_proj.weight`); expert e is row e, contiguous.
- Hugging Face: one tensor per expert (`...experts.{e}.gate_proj.weight`, Mixtral's `w1/w3/w2`).
Where the model's experts were packed (`storage/packed.py`), an expert is instead one row of a packed file,
read with one request. Reads go straight from the file into caller-owned staging rows; a whole stacked tensor
is never loaded. With direct I/O on (`use_direct_io`) reads bypass the OS page cache, as they must when the
model is larger than memory: Linux `O_DIRECT` (aligned spans through a per-thread bounce buffer; the
device copies, not the CPU) or macOS `F_NOCACHE`. This module does file I/O only (no MLX), so a reader
thread may call it. Not here: what to read, where it goes (`caching/layer_cache.py`) or counting it
(`accounting/ledger.py`).
"""

import errno
import hashlib
import json
import os
import struct
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ExpertReadError, UserError
from .layout import RAW_NUMPY_DTYPES, BlockLayout, ExpertBytes, ExpertIds, ExpertPart, ExpertRows

# Names a projection of mlx-lm's SwitchGLU / SwitchMLP has in per-expert Hugging Face checkpoints.
HF_PROJECTION_NAMES = {
    "gate_proj": ("gate_proj", "w1"),
    "up_proj": ("up_proj", "w3"),
    "down_proj": ("down_proj", "w2"),
    "fc1": ("fc1",),
    "fc2": ("fc2",),
}
HF_PART_NAMES = {"weight": "weight", "bias": "bias", "scales": "scales", "biases": "biases"}
DIRECT_ALIGN = 4096  # O_DIRECT wants aligned offsets, lengths and buffers; 4 KiB suits every device
BOUNCE_BYTES = 4 * 2**20  # per-thread aligned buffer for O_DIRECT reads


@dataclass(frozen=True)
class Span:
    """One request of an expert's read (`ExpertStore.spans`): `view`'s bytes from `offset` of a file."""

    file_index: int
    offset: int
    view: memoryview


def _open_direct(path: Path) -> tuple[int, bool]:
    """(fd, needs alignment) for reads that bypass the page cache; an OSError saying why where the OS or
    the file system offers no such reads (tmpfs refuses O_DIRECT, for example)."""
    if hasattr(os, "O_DIRECT"):
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    if sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        except OSError:
            os.close(fd)
            raise
        return fd, False
    raise OSError(errno.ENOTSUP, "this OS offers no reads past the page cache")


def _stamp(path: Path) -> tuple[int, int, int]:
    """(size, modification time in ns, inode) of the file at `path`."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def _why(error: OSError) -> str:
    return error.strerror or str(error)


@dataclass(frozen=True)
class TensorEntry:
    file: int
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def _read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UserError(
                f"{path} is not a safetensors file (too short): re-download or re-convert the model"
            )
        (n,) = struct.unpack("<Q", raw)
        header = f.read(n)
    if len(header) != n:
        raise UserError(f"{path} has a truncated safetensors header: re-download or re-convert the model")
    try:
        return 8 + n, json.loads(header)
    except json.JSONDecodeError:
        raise UserError(f"{path} has an unreadable safetensors header: re-download or re-convert the model")


class ExpertStore:
    """Index of a model folder's safetensors files and a reader of expert bytes (what was read is
    counted by the caller, in the ledger)."""

    def __init__(self, model_dir):
        self.model_dir = Path(model_dir)
        index_file = self.model_dir / "model.safetensors.index.json"
        if index_file.exists():
            names = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        else:
            names = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if not names:
            raise UserError(
                f"no .safetensors files in {self.model_dir}: point --model at an MLX or Hugging Face model "
                "folder"
            )
        self.files = [self.model_dir / n for n in names]
        self.tensors: dict[str, TensorEntry] = {}
        digest = hashlib.sha256()
        for i, path in enumerate(self.files):
            data_start, header = _read_header(path)
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}:".encode())
            digest.update(json.dumps(header, sort_keys=True).encode())
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                start, end = meta["data_offsets"]
                if data_start + end > size:
                    raise UserError(
                        f"{path} is truncated ({size} bytes, tensor {key} ends at {data_start + end}): "
                        "re-download the model"
                    )
                self.tensors[key] = TensorEntry(
                    i, data_start + start, end - start, meta["dtype"], tuple(meta["shape"])
                )
        self.weights_digest = digest.hexdigest()
        self._packed: dict[str, tuple] = {}  # module path -> (offset, shape) of its packed rows (last file)
        self._fds = [os.open(p, os.O_RDONLY) for p in self.files]
        # each file as it was loaded (size, modification time, inode): a read from a file changed since is
        # refused (`_unchanged`), since its bytes may no longer be those its header and the slots describe
        self._stamps = [_stamp(p) for p in self.files]
        self._direct: list[tuple[int, bool]] | None = None  # (fd, needs alignment) per file while it is on
        self._refused: str | None = None  # why direct I/O asked for is off (`direct_io_refused`)
        self._bounce = threading.local()
        self._drop_after_read = False  # `drop_pages_after_read`

    def drop_pages_after_read(self, on: bool = True):
        """Drop the pages just read from the page cache again (on), so that every read is cold, as on a
        machine whose page cache cannot hold the model: how benchmarks read cold."""
        self._drop_after_read = on

    def close(self):
        self.use_direct_io(False)
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    @property
    def direct_io(self) -> bool:
        """Whether reads bypass the page cache."""
        return self._direct is not None

    @property
    def nbytes(self) -> int:
        """Size of the model's safetensors files (packed experts are a copy: not counted)."""
        checkpoint = self.files[:-1] if self.packed is not None else self.files
        return sum(p.stat().st_size for p in checkpoint)

    def use_packed(self, path, rows: dict[str, tuple[int, tuple]]):
        """Read experts from packed rows (`storage/packed.py`): `rows` maps a block's module path to the
        offset of its expert 0 in the file at `path` and the shape (experts, expert bytes) of its rows.
        Layouts made before this call keep reading the checkpoint."""
        direct = self.direct_io
        self.use_direct_io(False)  # reopened below with the packed file among them
        self.files.append(Path(path))
        self._fds.append(os.open(path, os.O_RDONLY))
        self._stamps.append(_stamp(Path(path)))
        self._packed = dict(rows)
        self.use_direct_io(direct)

    def repack_advice(self, path) -> str:
        """What to do about packed experts at `path` that do not fit this model."""
        return f"run `od-moe pack {self.model_dir} --out {path}` again, or delete {path}"

    @property
    def packed(self) -> Path | None:
        """The packed experts file in use, if any."""
        return self.files[-1] if self._packed else None

    def use_direct_io(self, on: bool) -> bool:
        """Turn page-cache-bypassing reads on or off; returns whether they are on (off where unsupported)."""
        if not on and self._direct is not None:
            for fd, _ in self._direct:
                os.close(fd)
            self._direct = None
        elif on and self._direct is None:
            opened: list[tuple[int, bool]] = []
            try:
                for path in self.files:
                    opened.append(_open_direct(path))
            except OSError as e:
                for fd, _ in opened:
                    os.close(fd)
                self._refused = (
                    f"direct I/O is not possible for {path} ({_why(e)}): reads go through the page cache"
                )
                return False
            self._direct, self._refused = opened, None
        return self.direct_io

    @property
    def direct_io_refused(self) -> str | None:
        """Why reads go through the page cache after direct I/O was asked for (the file system refused it,
        as tmpfs and some overlays do), in one line; None where it was not refused."""
        return self._refused

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def block_layout(
        self, module_path: str, parts: Mapping[str, Sequence[str]], num_experts: int
    ) -> BlockLayout:
        """Locate the experts of the switch module at `module_path` (e.g. `model.layers.3.mlp.switch_mlp`).

        parts: projection name -> names of its per-expert arrays, as the loaded module has them
        (e.g. {"gate_proj": ["weight", "scales", "biases"], ...}).
        """
        parent = module_path.rsplit(".", 1)[0]
        finders = (("mlx", self._stacked_part, module_path), ("hf", self._per_expert_part, parent))
        for kind, find, prefix in finders:
            found = [find(prefix, proj, name, num_experts) for proj, names in parts.items() for name in names]
            if all(found):
                for part in found:
                    if part.dtype not in RAW_NUMPY_DTYPES:  # FP8 and the like need scales mlx-lm applies
                        raise UserError(
                            f"the experts of {module_path} are stored as {part.dtype}, which od-moe cannot "
                            "read exactly: convert the model with mlx_lm.convert (MLX layout) first"
                        )
                packed = None
                if self._packed:
                    offset, shape = self._packed.get(module_path, (0, None))
                    if shape != (num_experts, sum(part.nbytes for part in found)):  # its expert bytes
                        raise UserError(
                            f"the packed experts in {self.packed} do not hold {module_path} as this model "
                            f"has it: {self.repack_advice(self.packed)}"
                        )
                    packed = (len(self.files) - 1, offset)
                return BlockLayout(module_path, num_experts, found, kind, packed)
        raise UserError(
            f"cannot find the expert weights of {module_path} in {self.model_dir}: expected stacked tensors "
            f"'{module_path}.<proj>.weight' (MLX layout) or '{parent}.experts.<e>.<proj>.weight' (Hugging "
            "Face layout)"
        )

    def _stacked_part(self, module_path, proj, name, num_experts):
        entry = self.tensors.get(f"{module_path}.{proj}.{name}")
        if entry is None or not entry.shape or entry.shape[0] != num_experts:
            return None
        row = entry.nbytes // num_experts
        return ExpertPart(
            proj,
            name,
            entry.dtype,
            entry.shape[1:],
            np.full(num_experts, entry.file, np.int64),
            entry.offset + row * np.arange(num_experts, dtype=np.int64),
        )

    def _per_expert_part(self, parent, proj, name, num_experts):
        hf_name = HF_PART_NAMES.get(name)
        if hf_name is None:
            return None
        for candidate in HF_PROJECTION_NAMES.get(proj, (proj,)):
            entries = [
                self.tensors.get(f"{parent}.experts.{e}.{candidate}.{hf_name}") for e in range(num_experts)
            ]
            if all(entries) and len({(x.dtype, x.shape) for x in entries}) == 1:
                return ExpertPart(
                    proj,
                    name,
                    entries[0].dtype,
                    entries[0].shape,
                    np.array([x.file for x in entries], np.int64),
                    np.array([x.offset for x in entries], np.int64),
                )
        return None

    def read(self, layout: BlockLayout, ids: ExpertIds, staging: ExpertRows) -> ExpertBytes:
        """Read the experts `ids` (at most `staging.size`) into `staging`; returns views, row i = ids[i].

        Consecutive experts that lie back to back in a file are read with one `preadv`; from packed
        experts, each expert (or run of consecutive ones) is one request straight into its staging row.
        Raises `ExpertReadError` naming the file when it cannot be read or is shorter than its header says.
        """
        n = len(ids)
        if n > staging.size:
            raise ValueError(f"read of {n} experts exceeds the staging size {staging.size}")
        ids = np.asarray(ids, dtype=np.int64)
        if layout.packed is not None:  # expert i's row is staging row i: a run of experts is one span
            file_index, base = layout.packed
            size = layout.expert_nbytes
            self._refuse_changed(layout, ids, [file_index])
            for start, end in _runs([file_index] * n, (base + ids * size).tolist(), size):
                # numpy's stubs give ndarray the buffer protocol only for Python 3.12+; it has it on all
                views = [memoryview(staging.flat[start:end].reshape(-1))]  # type: ignore[arg-type]
                self._read_run(layout, ids[start:end], file_index, views, base + int(ids[start]) * size)
        else:  # one request per run of experts per array
            self.read_parts(layout, ids, staging.row_views)
        parts = {(p.proj, p.name): staging.buffers[(p.proj, p.name)][:n] for p in layout.parts}
        return ExpertBytes(parts, staging.flat[:n])

    def spans(self, layout: BlockLayout, expert: int, staging: ExpertRows, most: int) -> list[Span]:
        """Expert `expert`'s bytes as requests of at most about `most` bytes into `staging`'s row 0, cut at
        aligned file offsets (no block read twice with direct I/O): reader threads run them at once
        (`read_span`), where one request an expert would keep one in flight. No I/O here."""
        if layout.packed is not None:
            file_index, base = layout.packed
            flat = memoryview(staging.flat[0].reshape(-1))
            placed = [(file_index, base + expert * layout.expert_nbytes, flat)]
        else:
            placed = [
                (int(p.files[expert]), int(p.offsets[expert]), staging.row_views[(p.proj, p.name)][0])
                for p in layout.parts
            ]
        found = []
        for file_index, offset, view in placed:
            end, at = offset + len(view), offset
            while at < end:
                cut = max((at + most) // DIRECT_ALIGN * DIRECT_ALIGN, at + 1)
                cut = end if cut >= end else cut
                found.append(Span(file_index, at, view[at - offset : cut - offset]))
                at = cut
        return found

    def read_span(self, layout: BlockLayout, expert: int, span: "Span"):
        """One of `spans`' requests (on a reader thread), refused where its file changed since load; errors
        as `read` raises them."""
        ids = np.array([expert])
        self._refuse_changed(layout, ids, [span.file_index])
        self._read_run(layout, ids, span.file_index, [span.view], span.offset)

    def read_parts(self, layout: BlockLayout, ids: ExpertIds, row_views: dict[tuple[str, str], list]):
        """Read each part of the experts `ids` (not packed) into `row_views[(proj, name)][i]`, memory of that
        part's bytes for expert ids[i], anywhere (a staging row, a row of an array): one request per run
        of experts that lie back to back in a file. Raises `ExpertReadError` as `read` does."""
        ids = np.asarray(ids, dtype=np.int64)
        self._refuse_changed(layout, ids, np.unique([p.files[ids] for p in layout.parts]).tolist())
        for part in layout.parts:
            views = row_views[(part.proj, part.name)]
            files, offsets = part.files[ids].tolist(), part.offsets[ids].tolist()
            for start, end in _runs(files, offsets, part.nbytes):
                self._read_run(layout, ids[start:end], files[start], views[start:end], offsets[start])

    def _read_run(self, layout: BlockLayout, ids: np.ndarray, file_index: int, views: list, offset: int):
        """One request: the bytes at `offset` into `views`, a failure named as `read_error` names it."""
        try:
            self._pread_exact(file_index, views, offset)
        except OSError as e:
            raise self.read_error(layout, ids, e, file_index) from e

    def _refuse_changed(self, layout: BlockLayout, ids: np.ndarray, file_indices: list[int]):
        """Before a read of experts `ids`: a file it reads that changed since it was loaded is not read
        (`changed_error`), one look a file and a read."""
        for file_index in file_indices:
            try:
                how = self._changed(file_index)
            except OSError as e:  # gone, or no longer readable
                raise self.read_error(layout, ids, e, file_index) from e
            if how is not None:
                raise self.changed_error(file_index, how)

    def _changed(self, file_index: int) -> str | None:
        """How the file differs from the file loaded (its size, modification time or inode), or None."""
        was, now = self._stamps[file_index], _stamp(self.files[file_index])
        if now == was:
            return None
        if now[0] != was[0]:
            return f"{was[0]} bytes when loaded, {now[0]} now"
        return "modified since it was loaded" if now[2] == was[2] else "replaced by another file"

    def changed_error(self, file_index: int, how: str) -> ExpertReadError:
        """The one-line error for a read refused because the file changed since load: what to do."""
        return ExpertReadError(
            f"{self.files[file_index]} changed since od-moe loaded it ({how}): its experts are no longer "
            "read; load the model again (restart od-moe) to use the new files"
        )

    def read_error(
        self, layout: BlockLayout, ids: ExpertIds, error: BaseException, file_index: int | None = None
    ) -> ExpertReadError:
        """The one-line error for a failed read of experts `ids` of `layout` (from `file_index`, else
        from the files that hold them): which experts, which file, why, and what to do."""
        ids = np.asarray(ids, dtype=np.int64)
        if file_index is None and layout.packed is not None:
            indices = [layout.packed[0]]
        elif file_index is None:
            indices = sorted({int(f) for p in layout.parts for f in p.files[ids]})
        else:
            indices = [file_index]
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return ExpertReadError(
            f"cannot read expert{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids.tolist()))} of "
            f"{layout.module_path} from {', '.join(str(self.files[i]) for i in indices)} ({why}): the "
            "model's files changed or the disk failed; restore the model folder (copy or download it "
            "again) and send the request again"
        )

    def _pread_exact(self, file_index: int, views: list[memoryview], offset: int):
        """Fill `views` in turn from the file's bytes at `offset` (one `preadv` when nothing is short)."""
        if self._direct is not None:
            fd, aligned = self._direct[file_index]
            if aligned:
                return self._pread_aligned(fd, views, offset)
        else:
            fd = self._fds[file_index]
        total, done = sum(len(v) for v in views), 0
        while done < total:  # one request, but for a short read
            got = os.preadv(fd, _after(views, done) if done else views, offset + done)
            if got <= 0:
                raise OSError(f"short read at byte {offset + done}: the file is truncated or unreadable")
            done += got
        if self._drop_after_read and self._direct is None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, done, os.POSIX_FADV_DONTNEED)

    def _pread_aligned(self, fd: int, views: list[memoryview], offset: int):
        """O_DIRECT: read the aligned span around the bytes `views` take through the bounce buffer."""
        bounce = getattr(self._bounce, "buffer", None)
        if bounce is None:
            raw = np.empty(BOUNCE_BYTES + DIRECT_ALIGN, dtype=np.uint8)
            start = -raw.ctypes.data % DIRECT_ALIGN
            bounce = self._bounce.buffer = raw[start : start + BOUNCE_BYTES]
        # numpy's stubs give ndarray the buffer protocol only for Python 3.12+; it has it on all
        whole = memoryview(bounce)  # type: ignore[arg-type]
        end = offset + sum(len(v) for v in views)
        pos = offset - offset % DIRECT_ALIGN
        while pos < end:
            span = min(BOUNCE_BYTES, -(-(end - pos) // DIRECT_ALIGN) * DIRECT_ALIGN)
            got = os.preadv(fd, [whole[:span]], pos)
            lo, hi = max(offset, pos), min(end, pos + max(got, 0))
            if got <= 0 or (got < span and hi < end):
                raise OSError(f"short read at byte {max(pos, offset)}: the file is truncated or unreadable")
            at = lo - offset
            for view in _after(views, at):  # the bounce's bytes, spread over the views they belong to
                take = min(len(view), hi - lo)
                # numpy copies without the GIL (a memoryview's slice copy holds it), so reader threads
                # copying do not stall MLX's thread as it builds a layer
                np.frombuffer(view, np.uint8, take)[:] = bounce[lo - pos : lo - pos + take]
                lo += take
                if lo == hi:
                    break
            pos += span

    def drop_page_cache(self):
        """Ask the OS to forget this model's cached file pages, so the next reads are cold."""
        if not hasattr(os, "posix_fadvise"):
            return False
        for fd in self._fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True


def _runs(files: list[int], offsets: list[int], size: int):
    """(start, end) of each run of consecutive entries that lie back to back (`size` bytes apart) in one
    file: each is read with one request."""
    n, start = len(offsets), 0
    while start < n:
        end = start + 1
        while end < n and files[end] == files[start] and offsets[end] == offsets[end - 1] + size:
            end += 1
        yield start, end
        start = end


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` without their first `skip` bytes (as if they were one buffer)."""
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out
