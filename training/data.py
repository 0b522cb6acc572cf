"""Text sources for trace recording, read through `datasets`, and the held-out split by document.

A source is a local text file (one document per file), a JSON-lines / JSON / parquet / CSV file with a
text column, a folder of such files (searched recursively; binary files skipped), a Hugging Face hub
dataset name (needs network), or None for the bundled Python source set. Not here: tokenizing or running
the model (`record.py`).
"""

import codecs
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .bundled import BUNDLED_TEXT

_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_STRUCTURED = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Documents:
    texts: list[str]
    source: str
    text_field: str | None = None
    digest: str = field(default="")

    def __post_init__(self):
        if not self.digest:
            h = hashlib.sha256()
            for t in self.texts:
                h.update(hashlib.sha256(t.encode("utf-8", "replace")).digest())
            self.digest = h.hexdigest()[:16]

    def describe(self) -> dict:
        return {
            "source": self.source,
            "text_field": self.text_field,
            "documents": len(self.texts),
            "characters": sum(len(t) for t in self.texts),
            "sha256": self.digest,
        }


def _builder_for(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return _STRUCTURED.get(suffixes[-1] if suffixes else "", "text")


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        head.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return b"\0" not in head


def _not_utf8(files: list[Path]):
    """A UserError naming the first byte that is not UTF-8 in `files` (uncompressed ones), as `datasets`
    would not; nothing where every byte decodes. Called once `datasets` has failed."""
    for path in files:
        if path.suffix.lower() in _COMPRESSED or _builder_for(path) == "parquet":
            continue
        if (bad := _first_bad_byte(path)) is not None:
            offset, byte = bad
            raise UserError(
                f"{path} is not UTF-8 text (byte 0x{byte:02x} at offset {offset}): convert it (e.g. with "
                "iconv) or leave it out"
            )


def _first_bad_byte(path: Path) -> tuple[int, int] | None:
    """(offset, byte) of the first byte of `path` that does not decode as UTF-8, read in chunks."""
    offset, pending = 0, b""  # `offset`: where `pending`, a character a chunk's end split, starts
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            data = pending + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as e:
                return offset + e.start, data[e.start]
            if not chunk:
                return None
            offset, pending = offset + used, data[used:]


def _innermost(error: BaseException) -> BaseException:
    """The error under `datasets`' wrappers (its DatasetGenerationError says only that one happened)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _load_files(files: list[Path], builder: str, text_field: str) -> list[str]:
    import datasets

    datasets.disable_progress_bars()
    names = [str(f) for f in files]
    try:
        if builder == "text":
            ds = datasets.load_dataset("text", data_files=names, sample_by="document", split="train")
            column = "text"
        else:
            ds = datasets.load_dataset(builder, data_files=names, split="train")
            column = text_field
    except Exception as e:  # datasets raises many types for unreadable files
        _not_utf8(files)
        cause = _innermost(e)
        raise UserError(
            f"cannot read {', '.join(names[:3])} as {builder}: {type(cause).__name__}: {str(cause)[:200]}"
        )
    if column not in ds.column_names:
        raise UserError(
            f"{names[0]} has no column {column!r} (columns: {', '.join(ds.column_names)}): "
            f"pass --text-field with the column that holds the text"
        )
    try:  # arrow decodes the column's strings only now
        column_texts = list(ds[column])
    except UnicodeDecodeError as e:
        _not_utf8(files)
        raise UserError(
            f"cannot read {', '.join(names[:3])} as {builder}: its text is not UTF-8 ({e.reason})"
        )
    return [t for t in column_texts if isinstance(t, str) and t.strip()]


def load_documents(data: str | None = None, text_field: str = "text") -> Documents:
    """The documents of a source (see the module docstring); a UserError if there are none."""
    if data is None:
        return Documents(_load_files([BUNDLED_TEXT], "json", "text"), "bundled:python_source", "text")
    path = Path(data).expanduser()
    if path.is_file():
        texts = _load_files([path], _builder_for(path), text_field)
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
        )
        groups = {}
        for f in files:
            builder = _builder_for(f)
            if builder != "text" or _is_text(f):
                groups.setdefault(builder, []).append(f)
        texts = _load_text_groups(groups, text_field)
    elif str(data).count("/") <= 1 and not str(data).startswith((".", "/", "~")):
        texts = _load_hub(str(data), text_field)
    else:
        raise UserError(
            f"data {data} does not exist: give a text, JSON lines or parquet file, a folder, or a hub "
            "dataset name"
        )
    if not texts:
        raise UserError(f"no text found in {data}: the source is empty (or its --text-field column is)")
    return Documents(texts, str(path if path.exists() else data), text_field)


def _load_text_groups(groups: dict, text_field: str) -> list[str]:
    """A folder's documents: text files whole; structured files one by one, skipping those without the
    text column (a folder may hold configs beside its data), unless none has it."""
    texts, skipped = [], []
    for builder, files in sorted(groups.items()):
        if builder == "text":
            texts += _load_files(files, builder, text_field)
            continue
        for f in files:
            try:
                texts += _load_files([f], builder, text_field)
            except UserError as e:
                skipped.append(e)
    if not texts and skipped:
        raise skipped[0]
    return texts


def _load_hub(name: str, text_field: str) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:
        raise UserError(
            f"{name!r} is not a local path and could not be loaded from the Hugging Face hub "
            f"({type(e).__name__}): check the name and your network"
        )
    if text_field not in ds.column_names:
        raise UserError(
            f"dataset {name} has no column {text_field!r} (columns: {', '.join(ds.column_names)}): pass "
            "--text-field"
        )
    return [t for t in ds[text_field] if isinstance(t, str) and t.strip()]


def split_documents(docs: Documents, heldout_fraction: float = 0.1) -> tuple[Documents, Documents]:
    """(train, held-out), split by document on a digest of its text, so the split is stable and no
    document contributes to both. At least one document is held out when there are two or more."""
    scored = sorted(
        range(len(docs.texts)),
        key=lambda i: hashlib.sha256(docs.texts[i].encode("utf-8", "replace")).digest(),
    )
    n_held = max(1, round(len(scored) * heldout_fraction)) if len(scored) >= 2 else 0
    held = set(scored[:n_held])
    train = [t for i, t in enumerate(docs.texts) if i not in held]
    heldout = [t for i, t in enumerate(docs.texts) if i in held]
    return (
        Documents(train, docs.source + "#train", docs.text_field),
        Documents(heldout, docs.source + "#heldout", docs.text_field),
    )
