"""The draft every request of a server drafts with (`od-moe serve --draft-model` or `--prompt-lookup`).

Loaded on the generation thread once the engine is (`drafts.prepare`: checked against it; a folder loaded
resident); with it requests run one at a time, as in mlx-lm's server (batching is off, said in one line at
start), their prompt cache holding the target's KV caches and the draft's. A request may set
`num_draft_tokens` (mlx-lm's server takes it), not pick another draft (`requests.check_draft`).
Not here: drafting itself (`od_moe/generation/drafts.py`, mlx-lm's loop), the one-at-a-time path
(`one_at_a_time.py`).
"""

from ..errors import UserError
from ..generation.drafts import CLI_DRAFT_TOKENS, Draft, prepare
from ..generation.prompt_lookup import PromptLookup


class ServerDraft:
    """The draft (`draft`: a `drafts.Draft` once loaded; None: none) and the tokens it drafts a pass."""

    def __init__(self, source=None, num_draft_tokens: int = CLI_DRAFT_TOKENS, across_ranks: bool = False):
        if source is not None and across_ranks:  # refused on every rank, before any loads
            raise UserError("--draft-model does not run across ranks yet: serve with a draft in one process")
        self.source, self.num_draft_tokens = source, num_draft_tokens
        self.draft: Draft | None = None

    def load(self, engine):
        """Load the draft asked for, checked against `engine` (a UserError where it cannot draft for it)."""
        if self.source is not None and self.draft is None:
            self.draft = prepare(engine, self.source, None, {})

    @property
    def name(self) -> str | None:
        return self.draft.name if self.draft is not None else None

    def batch_cut(self, max_batch: int) -> str:
        drafter = "prompt lookup" if isinstance(self.source, PromptLookup) else "a draft model"
        return f"batching is off with {drafter}: one request at a time (--max-batch {max_batch})"

    def caches_of(self, engine):
        """What a new prompt cache is made for: the model, or with a draft the model and the draft."""
        return engine.model if self.draft is None else self.draft.cache_maker(engine.model)

    def options(self, params) -> dict:
        """`Engine.stream_generate`'s drafting arguments for a request's `params` (none without a draft)."""
        if self.draft is None:
            return {}
        asked = params.num_draft_tokens
        return {
            "draft_model": self.draft,
            "num_draft_tokens": self.num_draft_tokens if asked is None else asked,
        }

    def figures(self, stats: dict) -> dict:
        """For /health and the live page: the ledger's drafting counts (`stats.draft_counts`), the draft and
        the tokens it drafts a pass (None: no draft)."""
        drafting = self.draft is not None
        return dict(
            stats["drafts"], model=self.name, num_draft_tokens=self.num_draft_tokens if drafting else None
        )
