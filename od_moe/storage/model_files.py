"""A model's files: the folder a name means (the embedded default, a local folder, a hub id where there is
network), its maximum positions and identity, its expert store (packed rows, reads past the page cache)
and mlx-lm's lazy model and tokenizer. Not here: the engine built on them (`engine.py`).
"""

import hashlib
import json
import sys
from pathlib import Path

import mlx_lm

from ..errors import UserError
from ..memory import backend
from .packed import default_path as default_packed_path
from .packed import use_packed
from .store import ExpertStore

DEFAULT_MODEL = Path(__file__).parents[1] / "models" / "tiny-qwen3-moe-4bit"
# A shadow predictor for it, made by `od-moe train-predictor` (its report.json is beside it).
DEFAULT_PREDICTOR = Path(__file__).parents[1] / "models" / "tiny-qwen3-moe-4bit-predictor"
# A draft model for it (`--draft-model`): a dense Qwen3 trained on the same data (its README says how).
DEFAULT_DRAFT = Path(__file__).parents[1] / "models" / "tiny-qwen3-draft-4bit"


def resolve_model_path(model: str | None) -> Path:
    """A local model folder for `model`: None is the embedded default; a missing path that looks like
    a hub id ("org/name") is fetched the way mlx-lm fetches it (needs network)."""
    if model is None:
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(
                f"{path} is not a model folder (it has no config.json): point --model at an MLX or Hugging "
                "Face model folder"
            )
        return path
    if str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
        try:
            from ..model_surgery.mlx_lm_private import download

            return Path(download(str(model)))
        except Exception as e:
            raise UserError(
                f"model {model!r} is not a local folder and could not be fetched from the Hugging Face hub "
                f"({type(e).__name__}): check the name and your network"
            )
    raise UserError(
        f"model folder {model} does not exist: give the path of an MLX or Hugging Face model folder"
    )


def max_positions(model_path: Path, fallback: int = 16384) -> int:
    """The longest sequence, prompt and generated tokens together, the model was made for (its config's
    maximum positions; `fallback` where the config names none)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return fallback
    for c in (config, config.get("text_config") or {}):
        value = c.get("max_position_embeddings") or c.get("max_sequence_length")
        if isinstance(value, int) and value > 0:
            return value
    return fallback


def model_identity(path: Path, store: ExpertStore) -> str:
    """A digest of the model's config and safetensors headers: what a snapshot or predictor is tied to."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    digest.update(store.weights_digest.encode())
    return digest.hexdigest()[:16]


def open_store(path: Path, packed, direct_io) -> ExpertStore:
    """The model's expert store (every safetensors header checked against its file first), reading
    packed rows and past the page cache as `load` says."""
    store = ExpertStore(path)
    use_packed_experts(store, path, packed)
    if direct_io not in (True, False, "auto"):
        raise UserError(f"direct_io must be True, False or 'auto', got {direct_io!r}")
    if direct_io is True or direct_io == "auto" and store.nbytes > backend.available_memory_bytes():
        if not store.use_direct_io(True):  # never silently: the page cache then holds what is read
            print(f"od-moe: {store.direct_io_refused}", file=sys.stderr)
    return store


def open_model(path: Path, dtype: str):
    """mlx-lm's model (lazy: nothing read yet) and tokenizer, cast to the compute dtype."""
    target_dtype = backend.compute_dtype(dtype)
    try:
        # mlx_lm.load's annotation is a union over `return_config`, with no overload: two items here
        mlx_model, tokenizer = mlx_lm.load(str(path), lazy=True)  # type: ignore[misc]
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        raise UserError(f"mlx-lm cannot load {path}: {e}")
    if len(tokenizer.get_vocab()) < 2:  # transformers falls back to an empty tokenizer without files
        raise UserError(
            f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): copy the model's "
            "tokenizer files into the folder"
        )
    if target_dtype is not None:
        mlx_model.set_dtype(target_dtype)
    return mlx_model, tokenizer


def use_packed_experts(store: ExpertStore, path: Path, packed):
    """Read from packed experts as `load`'s `packed` says (before any layout is made)."""
    if packed is True or packed == "auto":
        where = default_packed_path(path)
    elif packed is False:
        return
    elif isinstance(packed, (str, Path)):
        where = Path(packed).expanduser()
    else:
        raise UserError(f"packed must be True, False, 'auto' or a file path, got {packed!r}")
    if not use_packed(store, where) and packed != "auto":
        raise UserError(f"no packed experts at {where}: make them with `od-moe pack {path} --out {where}`")
