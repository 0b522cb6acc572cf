"""Speculative decoding with a draft model, as mlx-lm does it, on an engine whose experts are offloaded.

mlx-lm's own loop runs it (`speculative_generate_step`, by `mlx_lm.stream_generate(draft_model=...)`): the
draft proposes k tokens, the target verifies them in one pass over k + 1 positions and keeps the longest
prefix it agrees with, plus its own next token; both KV caches are trimmed back past what it rejected. On
an offloaded MoE a verify pass routes its k + 1 positions to the union of their experts, so each expert
read or copied serves several tokens. The tokens are stock mlx-lm's drafting on the same target and draft
(which may differ from undrafted greedy output: a pass of k + 1 positions runs other kernels).

`prepare` takes what `Engine.stream_generate` is given as `draft_model` (names and meaning as mlx-lm's):
a model folder or hub id, loaded whole with mlx-lm and kept resident (one at a time is kept loaded); an
mlx-lm model (an `nn.Module`); another od-moe engine (its experts offloaded in its own budget; its reads are
in its own ledger); or a `Draft` already made. It refuses, with a `UserError`, a draft whose vocabulary is
not the target's, a target or draft whose KV cache cannot be rewound (Qwen3-Next's linear-attention layers,
as mlx-lm refuses them) and drafting across ranks. `Verifier` is the target as mlx-lm's loop calls it: the
passes after the prompt's are verify passes, counted so (`accounting/ledger.py`: drafted, accepted, verify
passes) and booked as decode. `responses` picks the loop: mlx-lm's for a draft model, prompt lookup's own
(`generation/prompt_lookup.py`) for drafts from the text so far. Not here: either loop, a draft offloaded in
the target's own budget.
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import UserError
from ..runtime import Runtime
from ..storage.model_files import open_model, resolve_model_path
from .prompt_lookup import LookupCounts, PromptLookup, stream_lookup
from .sampling import vocab_size_of

# mlx-lm's draft length: its `generate` and `server` commands draft 3 tokens (`--num-draft-tokens`); its
# Python `stream_generate` leaves the count to `speculative_generate_step`, whose default is 2
CLI_DRAFT_TOKENS = 3


@dataclass
class Draft:
    """A draft model ready to draft for one target: what mlx-lm calls, its tokenizer (None: not known, an
    `nn.Module` given alone), a name for messages and /health, and its runtime where it is an engine."""

    model: nn.Module  # an engine's `forward` is what its runtime gives as one (`Runtime.generation_model`)
    tokenizer: TokenizerWrapper | None
    name: str
    runtime: Runtime | None = None

    def cache_maker(self, target):
        """An object whose `make_cache()` gives `target`'s KV caches then the draft's, as mlx-lm's loop
        takes them in one `prompt_cache` list (the server's prompt-cache reuse makes them so)."""
        return _BothCaches(target, self.model)


class _BothCaches:
    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def make_cache(self) -> list:
        return make_prompt_cache(self.target) + make_prompt_cache(self.draft)


_loaded: dict[str, Draft] = {}  # the last draft loaded from a folder, by its path


def prepare(engine, draft_model, num_draft_tokens, kwargs: dict) -> Draft | None:
    """`draft_model` as a `Draft` checked against `engine` (None: no drafting), or a UserError saying what
    stands in the way; `num_draft_tokens`, where given, put into mlx-lm's `kwargs`."""
    if draft_model is None:
        return None
    if num_draft_tokens is not None and (
        isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 0
    ):
        raise UserError(f"num_draft_tokens must be a non-negative integer, got {num_draft_tokens!r}")
    if engine.stage is not None:
        raise UserError("drafting does not run across ranks yet: run the draft model in one process")
    draft = _draft_of(engine, draft_model)
    _check_vocabulary(engine, draft)
    for who, model in (("the target", engine.model), (f"the draft {draft.name}", draft.model)):
        caches = make_prompt_cache(model)
        if not can_trim_prompt_cache(caches):
            kinds = ", ".join(sorted({type(c).__name__ for c in caches if not c.is_trimmable()}))
            raise UserError(
                f"{who} keeps a KV cache that cannot be rewound ({kinds}), as drafting needs (mlx-lm "
                "refuses it too): generate without a draft model"
            )
    if num_draft_tokens is not None:
        kwargs["num_draft_tokens"] = num_draft_tokens
    return draft


def _draft_of(engine, draft_model) -> Draft:
    if isinstance(draft_model, Draft):
        return draft_model
    if isinstance(draft_model, type(engine)):  # another od-moe engine
        if draft_model is engine:
            raise UserError(
                "an engine cannot draft for itself: load the draft as another engine, or give a path"
            )
        if draft_model.stage is not None:
            raise UserError("drafting does not run across ranks yet: run the draft model in one process")
        name = str(draft_model.model_path)
        return Draft(draft_model.forward, draft_model.tokenizer, name, draft_model.runtime)
    if isinstance(draft_model, PromptLookup):  # drafts the target's own tokens
        draft_model.fit_vocab(vocab_size_of(engine.model))
        return Draft(draft_model, engine.tokenizer, "prompt lookup")
    if isinstance(draft_model, nn.Module):
        return Draft(draft_model, None, type(draft_model).__name__)
    if isinstance(draft_model, (str, Path)):
        try:
            path = resolve_model_path(str(draft_model))
            key = str(path.resolve())
            if key not in _loaded:
                model, tokenizer = open_model(path, "auto")  # resident: every weight read now
                mx.eval(model.parameters())
                _loaded.clear()
                _loaded[key] = Draft(model, tokenizer, str(draft_model))
        except UserError as e:
            raise UserError(f"the draft model: {e}") from None
        return _loaded[key]
    raise UserError(
        "draft_model must be a model folder, an mlx-lm model or an od-moe engine, got "
        f"{type(draft_model).__name__}"
    )


def _check_vocabulary(engine, draft: Draft):
    """The draft's tokens must mean what the target's do: the same vocabulary where its tokenizer is known,
    else the same number of logits."""
    if draft.tokenizer is not None:
        ours, theirs = engine.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if ours != theirs:
            differ = len(set(ours.items()) ^ set(theirs.items()))
            raise UserError(
                f"the draft model {draft.name} has another tokenizer than the target ({len(theirs)} tokens "
                f"against {len(ours)}, {differ} entries differ): a draft must share the target's vocabulary"
            )
        return
    ours, theirs = vocab_size_of(engine.model), vocab_size_of(draft.model)
    if ours and theirs and ours != theirs:
        raise UserError(
            f"the draft model has {theirs} logits per token and the target {ours}: a draft must share the "
            "target's vocabulary"
        )


class Verifier:
    """The target as mlx-lm's drafting loop calls it (`model(inputs, cache=...)`): the passes that take
    the prompt's first `prefill` tokens are the prompt's; every later one verifies its drafts (all its
    positions but the first). The first such pass settles the prompt's counts, then the ledger books passes
    as decode (`Ledger.book_verifying`) until the engine ends the generation. `counts`: whether its passes
    count as verify passes (the target's; a draft engine's own passes are only booked as decode). Every
    other attribute is the model's."""

    def __init__(self, forward, runtime: Runtime, prefill: int, counts: bool = True):
        object.__setattr__(self, "_forward", forward)
        object.__setattr__(self, "_runtime", runtime)
        object.__setattr__(self, "_prefill", prefill)
        object.__setattr__(self, "_counts", counts)

    def __getattr__(self, name):
        return getattr(self._forward, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        positions, ledger = inputs.shape[-1], self._runtime.ledger
        if self._prefill > 0:
            object.__setattr__(self, "_prefill", self._prefill - positions)
        else:
            if not ledger.verifying:
                self._runtime.settle()  # the prompt's passes, booked as prefill first
                ledger.book_verifying(True)
            if self._counts and positions > 1:  # prompt lookup's passes with nothing found decode plainly
                ledger.count_verify(positions - 1)
        return self._forward(inputs, cache=cache, **kwargs)


def responses(engine, draft: Draft | None, prompt: list[int], max_tokens: int, sampler, kwargs: dict):
    """mlx-lm's `GenerationResponse`s for `prompt` on `engine`: undrafted or drafted by a model (mlx-lm's
    own loops, `mlx_lm.stream_generate`), or drafted by prompt lookup (its own loop, which drafts only
    where a lookup finds something: `prompt_lookup.lookup_generate_step`)."""
    if draft is None:
        return mlx_lm.stream_generate(
            engine.forward, engine.tokenizer, prompt, max_tokens=max_tokens, sampler=sampler, **kwargs
        )
    target, drafter = verifying(engine, draft, prompt)
    if isinstance(draft.model, PromptLookup):
        lookup, counts = draft.model, LookupCounts()
        stream = stream_lookup(
            target,
            engine.tokenizer,
            prompt,
            max_tokens,
            counts,
            sampler=sampler,
            lookup=lookup,
            **kwargs,
        )
        return _found(stream, counts, lookup, engine.runtime.ledger)
    # mlx-lm annotates its models as `nn.Module`; its loop only calls them and reads their attributes, which
    # a `Verifier` forwards to the model it wraps
    return mlx_lm.stream_generate(
        target,  # type: ignore[arg-type]
        engine.tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampler=sampler,
        draft_model=drafter,  # type: ignore[arg-type]
        **kwargs,
    )


def _found(stream, counts: LookupCounts, lookup: PromptLookup, ledger):
    """`stream`, then (however it ends) what its lookups drafted and had accepted, by where they were found,
    added to the lookup's counts and the engine's ledger."""
    try:
        yield from stream
    finally:
        lookup.count(counts)
        ledger.count_found(counts.drafted, counts.accepted)


def verifying(engine, draft: Draft, prompt: list[int]) -> tuple[Verifier, nn.Module | Verifier]:
    """The target and the draft as mlx-lm's loop is to call them for `prompt` (a draft engine's passes
    booked as decode in its own ledger once the prompt is in)."""
    target = Verifier(engine.forward, engine.runtime, len(prompt) - 1)
    if draft.runtime is None:
        return target, draft.model
    return target, Verifier(draft.model, draft.runtime, len(prompt) - 1, counts=False)


def stop_verifying(engine, draft: Draft):
    """After a drafted generation: its counts settled as decode, later passes booked by their shape again."""
    for runtime in (engine.runtime, draft.runtime):
        if runtime is not None:
            runtime.settle()
            runtime.ledger.book_verifying(False)
