"""Packed experts: a copy of a model's expert bytes with each expert in one contiguous row.

In a checkpoint the arrays of one expert (gate/up/down weights, and scales and biases when quantized) lie
in as many tensors: reading an expert is 6 to 9 requests of 0.1-0.8 MB at scattered offsets, where an SSD
is far from its speed at one large request, and each request is a system call that gives up Python's GIL
and waits to take it back. `pack` writes, per MoE block, one (experts, expert bytes) uint8 tensor whose
row e is expert e's arrays back to back in `BlockLayout.parts` order (what staging holds, and what an
install copies from), as a safetensors file, by default `<model>/od-moe-packed/experts.safetensors`.
`load()` finds it there (or is given its path) and reads every expert with one request straight into its
staging row (`ExpertStore.read`). The file records the digest of the checkpoint's headers it was made
from; a copy made from other weights is refused with what to do.

The cost is disk space: a second copy of the experts (the checkpoint stays what mlx-lm loads). Not here:
reading (`storage/store.py`), or what an engine does with the bytes.
"""

import contextlib
import json
import os
import struct
from pathlib import Path

from ..errors import ExpertReadError, UserError
from .layout import BlockLayout, ExpertRows
from .store import ExpertStore, _read_header

PACKED_DIR = "od-moe-packed"
PACKED_FILE = "experts.safetensors"
FORMAT = "od-moe-packed-1"
PACK_BATCH_BYTES = 64 * 2**20  # experts read and written at a time


def default_path(model_dir) -> Path:
    """Where `pack` writes and `load()` looks by default: inside the model folder."""
    return Path(model_dir) / PACKED_DIR / PACKED_FILE


def pack(store: ExpertStore, layouts: list[BlockLayout], out=None, progress=None) -> Path:
    """Write the packed experts of `layouts` (all the model's MoE blocks) read through `store`; returns
    the file's path. Written under a temporary name and renamed, so a file that exists is whole.
    `progress(nbytes)` is called as expert bytes are written."""
    out = default_path(store.model_dir) if out is None else Path(out)
    header = {"__metadata__": {"format": FORMAT, "weights_digest": store.weights_digest}}
    offset = 0
    for layout in layouts:
        nbytes = layout.num_experts * layout.expert_nbytes
        header[layout.module_path] = {
            "dtype": "U8",
            "shape": [layout.num_experts, layout.expert_nbytes],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors: data starts 8-byte aligned
    partial = out.with_name(out.name + ".partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            for layout in layouts:
                batch = max(1, PACK_BATCH_BYTES // layout.expert_nbytes)
                staging = ExpertRows(layout, min(batch, layout.num_experts))
                for start in range(0, layout.num_experts, staging.size):
                    ids = range(start, min(start + staging.size, layout.num_experts))
                    # numpy's stubs give ndarray the buffer protocol only for Python 3.12+; it has it on all
                    f.write(store.read(layout, list(ids), staging).flat)  # type: ignore[arg-type]
                    if progress is not None:
                        progress(len(ids) * layout.expert_nbytes)
        os.replace(partial, out)
    except ExpertReadError:  # the checkpoint, not the destination: its own message says what to do
        raise
    except OSError as e:
        raise UserError(
            f"cannot write packed experts to {out} ({e.strerror or e}): choose another place with --out "
            "FILE, then pass --packed FILE (load(packed=FILE) in Python)"
        )
    finally:
        with contextlib.suppress(OSError):  # renamed when whole; else nothing half-written is left
            partial.unlink(missing_ok=True)
    return out


def use_packed(store: ExpertStore, path) -> bool:
    """Have `store` read experts from the packed file at `path` (before its layouts are made); False if
    there is no file. A file made from other weights, or truncated, is a UserError."""
    path = Path(path)
    if not path.is_file():
        return False
    data_start, header = _read_header(path)
    meta = header.pop("__metadata__", None) or {}
    redo = store.repack_advice(path)
    if meta.get("format") != FORMAT or meta.get("weights_digest") != store.weights_digest:
        raise UserError(f"the packed experts in {path} were not made from these weights: {redo}")
    if max((data_start + e["data_offsets"][1] for e in header.values()), default=0) > path.stat().st_size:
        raise UserError(f"the packed experts in {path} are truncated: {redo}")
    rows = {module: (data_start + e["data_offsets"][0], tuple(e["shape"])) for module, e in header.items()}
    store.use_packed(path, rows)
    return True
