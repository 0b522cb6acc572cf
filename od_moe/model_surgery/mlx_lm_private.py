"""mlx-lm's private names od-moe relies on, in one place: what each is for, and where od-moe uses it.

An mlx-lm release may move any of them; `tests/test_mlx_lm_private.py` then fails by name, rather than a
server quietly sending first tokens a step late. Not here: mlx-lm's public API (`load`, `stream_generate`,
`BatchGenerator`, the models' classes), which od-moe uses directly.
"""

from mlx_lm.models.cache import _BaseCache as BaseCache  # every KV cache's base (`distributed/rank_split.py`)
from mlx_lm.utils import (
    _download as download,
)  # a hub id to a local snapshot folder (`storage/model_files.py`)
from mlx_lm.utils import _get_classes as model_classes  # the model and args classes of a config

__all__ = ["BaseCache", "download", "model_classes", "pending_tokens"]


def pending_tokens(generator) -> tuple[list[int], object] | None:
    """A `BatchGenerator`'s sequences and the tokens its last step computed but has not given out yet
    (mlx-lm 0.32: `_generation_batch.uids` and `_next_tokens`), as (uids, a lazy array); None where this
    mlx-lm keeps them elsewhere (the server then sends a joining sequence's first token a step later,
    `server/batching.py`)."""
    batch = getattr(generator, "_generation_batch", None)
    pending = getattr(batch, "_next_tokens", None)
    if pending is None:
        return None
    return list(getattr(batch, "uids", ())), pending
