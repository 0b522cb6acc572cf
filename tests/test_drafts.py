"""Drafts (issue #57): speculative decoding on an offloaded MoE, exact by the right reference, and seen.

The reference is stock mlx-lm doing the same verify passes: `mlx_lm.stream_generate(model, tokenizer, prompt,
draft_model=draft, num_draft_tokens=k)` on the same target (every expert resident) and the same draft. The
drafts: the bundled draft model (`od_moe.DEFAULT_DRAFT`, a dense model trained on the bundled model's data,
accepting part of what it drafts), and the bundled model itself (the target in disguise, accepting nearly
all, proving only the mechanism). Agreement with undrafted greedy output is reported by the docs, not
required here, for a draft model. Prompt lookup runs a loop of od-moe's own, so its tokens are held to stock
mlx-lm's undrafted greedy output as well (exact on this CPU backend, float32), besides that loop run on
stock's model.
"""

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models.cache import make_prompt_cache

import od_moe
from conftest import PROMPTS
from od_moe.accounting.ledger import Ledger
from od_moe.accounting.report import decode_line
from od_moe.cli import main
from od_moe.generation.drafts import Verifier
from od_moe.memory import backend
from od_moe.server import create_app
from od_moe.server.prompt_cache import PromptCache
from tiny_models import FAMILIES, LLAMA, write_mlx_model

K, TOKENS = 3, 24
CAPACITIES = (0.125, 0.25, 0.5, 1.0)


def _stock(path=od_moe.DEFAULT_MODEL):
    """Stock mlx-lm's model at `path` in od-moe's compute dtype."""
    model, tokenizer = mlx_lm_load(str(path))
    dtype = backend.compute_dtype()
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer


@pytest.fixture(scope="module")
def stock():
    """(target, tokenizer, the bundled draft model, the whole target as a draft), all resident."""
    target, tokenizer = _stock()
    return target, tokenizer, _stock(od_moe.DEFAULT_DRAFT)[0], _stock()[0]


def _reference(stock, draft, prompt, max_tokens=TOKENS, k=K):
    target, tokenizer = stock[0], stock[1]
    stream = mlx_lm_stream_generate(
        target, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=k
    )
    return [(r.token, r.from_draft) for r in stream]


@pytest.mark.parametrize("two_tier", [False, True], ids=["per-layer", "two-tier"])
def test_drafted_tokens_equal_stock_drafting_at_every_capacity(stock, two_tier):
    """Greedy tokens, and which came from the draft, are stock mlx-lm's drafting on the same pair at 12.5,
    25, 50 and 100% of experts; the ledger books verify passes as decode and counts what was drafted."""
    draft = stock[2]
    references = [_reference(stock, draft, p) for p in PROMPTS]
    accepted = [sum(f for _, f in ref) for ref in references]
    assert 0 < sum(accepted) < sum(len(ref) for ref in references)  # drafts accepted and rejected alike
    for capacity in CAPACITIES:
        engine = od_moe.load(capacity=capacity, two_tier=two_tier)
        assert engine.mode.path == ("two-tier" if two_tier else "per-layer")
        prefill = 0
        for prompt, ref in zip(PROMPTS, references):
            got = engine.stream_generate(prompt, max_tokens=TOKENS, draft_model=draft, num_draft_tokens=K)
            assert [(r.token, r.from_draft) for r in got] == ref, (capacity, prompt)
            prefill += len(engine.encode(prompt)) - 1
        stats = engine.stats()
        d = stats["drafts"]
        assert stats["positions"]["prefill"] == prefill  # the prompts' passes only: no verify pass among them
        assert stats["passes"]["decode"] == d["verify_passes"]  # with drafting every decode pass verifies
        assert stats["positions"]["decode"] == d["verify_passes"] + d["drafted"]
        assert d["accepted"] == sum(accepted)
        assert stats["generated_tokens"] == sum(len(ref) for ref in references)
        assert d["acceptance_rate"] == pytest.approx(d["accepted"] / d["drafted"])
        assert stats["total"]["decode"]["lookups"] == stats["positions"]["decode"] * engine.top_k * 8
        if capacity < 1:
            assert stats["experts_per_token"] > 0
        engine.close()


def test_the_bundled_draft_is_a_smaller_model_of_its_own():
    """The bundled draft shares the target's tokenizer, holds no experts, has under a fifth of the
    target's parameters, and agrees with it on part of the code prompts, not all."""
    from mlx.utils import tree_flatten

    draft, draft_tokenizer = _stock(od_moe.DEFAULT_DRAFT)
    target, tokenizer = _stock()
    assert draft_tokenizer.vocab == tokenizer.vocab
    assert not any("experts" in name for name, _ in tree_flatten(draft.parameters()))
    sizes = [
        json.loads((p / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        for p in (od_moe.DEFAULT_DRAFT, od_moe.DEFAULT_MODEL)
    ]
    assert sizes[0] < sizes[1] / 5
    from_draft = [f for p in PROMPTS for _, f in _reference((target, tokenizer), draft, p, k=3)]
    print(f"{sum(from_draft)} of {len(from_draft)} tokens came from the draft")
    assert 0.3 < sum(from_draft) / len(from_draft) < 0.95


def test_a_draft_by_path_and_an_engine_as_draft(stock):
    """A folder is loaded resident with mlx-lm; another engine drafts through its own offloaded experts
    (its passes booked in its own ledger); both give stock's drafting tokens."""
    target = od_moe.load(capacity=0.25)
    prompt = PROMPTS[0]
    ref = _reference(stock, stock[3], prompt, k=2)
    by_path = target.stream_generate(prompt, max_tokens=TOKENS, draft_model=str(od_moe.DEFAULT_MODEL))
    assert [(r.token, r.from_draft) for r in by_path] == ref  # None drafts as mlx-lm's default, 2 a pass
    assert target.stats()["drafts"]["acceptance_rate"] > 0.9  # the target in disguise

    drafter = od_moe.load(capacity=0.5)
    target.reset_stats()
    got = target.stream_generate(prompt, max_tokens=TOKENS, draft_model=drafter, num_draft_tokens=2)
    assert [(r.token, r.from_draft) for r in got] == ref
    own = drafter.stats()
    assert own["positions"]["prefill"] == len(target.encode(prompt)) - 1
    assert own["passes"]["decode"] > 0 and own["drafts"]["verify_passes"] == 0
    assert target.stats()["drafts"]["verify_passes"] > 0
    target.close()
    drafter.close()


def test_drafting_lowers_the_experts_read_per_token():
    """At 25%, verify passes over a draft's tokens read fewer experts per generated token than one
    position at a time (each expert read serves several positions)."""
    prompt, moved = PROMPTS[2], {}
    for drafting in (False, True):
        engine = od_moe.load(capacity=0.25)
        options = dict(draft_model=str(od_moe.DEFAULT_MODEL), num_draft_tokens=4) if drafting else {}
        for _ in engine.stream_generate(prompt, max_tokens=32, **options):
            pass
        moved[drafting] = engine.stats()["experts_per_token"]
        engine.close()
    assert moved[True] < 0.8 * moved[False], moved


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A tiny random llama whose tokenizer swaps two of the bundled tokenizer's ids."""
    path = write_mlx_model(tmp_path_factory.mktemp("drafts") / "llama", LLAMA)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["test"], vocab["()"] = vocab["()"], vocab["test"]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def test_drafts_that_cannot_draft_are_one_clear_error(other_tokenizer, tmp_path, capsys):
    engine = od_moe.load(capacity=0.25)
    cases = [
        (dict(draft_model=str(other_tokenizer)), "another tokenizer"),
        (dict(draft_model=engine), "cannot draft for itself"),
        (dict(draft_model=str(od_moe.DEFAULT_MODEL), num_draft_tokens=-1), "non-negative"),
        (dict(draft_model=str(tmp_path / "absent")), "the draft model: model folder"),
        (dict(draft_model=3), "must be a model folder"),
    ]
    for options, message in cases:
        with pytest.raises(od_moe.UserError, match=message):
            next(engine.stream_generate("def f(x):", max_tokens=4, **options))
    small, _ = _stock(od_moe.DEFAULT_DRAFT)
    small.args.vocab_size = 1024  # as a model of another vocabulary says
    with pytest.raises(od_moe.UserError, match="1024 logits per token"):
        next(engine.stream_generate("def f(x):", max_tokens=4, draft_model=small))
    engine.stage = object()  # split over ranks
    with pytest.raises(od_moe.UserError, match="across ranks"):
        next(engine.stream_generate("def f(x):", max_tokens=4, draft_model=str(od_moe.DEFAULT_MODEL)))
    engine.stage = None
    assert len(list(engine.stream_generate("def f(x):", max_tokens=4))) == 4  # the engine is unharmed
    engine.close()
    code = main(["generate", "--prompt", "x", "--max-tokens", "2", "--draft-model", str(other_tokenizer)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("od-moe: error: the draft model")


def test_a_target_whose_cache_cannot_be_rewound_is_refused(tmp_path):
    """Qwen3-Next's linear-attention layers keep a cache mlx-lm cannot trim: refused, as mlx-lm refuses it."""
    path = write_mlx_model(tmp_path / "qwen3_next", FAMILIES["qwen3_next"])
    engine = od_moe.load(str(path), capacity=0.5)
    with pytest.raises(
        od_moe.UserError, match=r"target keeps a KV cache that cannot be rewound \(ArraysCache"
    ):
        next(engine.stream_generate([1, 2, 3], max_tokens=4, draft_model=str(path)))
    engine.close()


def test_the_ledger_books_verify_passes_as_decode():
    ledger = Ledger(2)
    ledger.count_forward("prefill", 5)
    ledger.add("prefill", 0, lookups=3)
    ledger.book_verifying(True)
    ledger.count_forward("prefill", 4)  # a verify pass of 3 drafts: shaped as a prompt's
    ledger.count_verify(3)
    ledger.count_lookups("prefill", 1, 8, 6)
    ledger.count_generated(1, from_draft=True)
    ledger.count_generated(1, from_draft=False)
    ledger.count_generated(0, from_draft=True)  # the last response repeats the count before it
    assert ledger.passes == {"prefill": 1, "decode": 1}
    assert ledger.positions == {"prefill": 5, "decode": 4}
    assert ledger.total("lookups", "decode") == 8 and ledger.total("lookups", "prefill") == 3
    snap = ledger.snapshot()
    assert (snap.verify_passes, snap.drafted, snap.accepted, snap.generated) == (1, 3, 1, 2)
    ledger.reset()
    assert (ledger.verify_passes, ledger.drafted, ledger.accepted) == (0, 0, 0)


def test_the_verifier_counts_passes_after_the_prompt():
    class Runtime:
        settled = 0

        def __init__(self):
            self.ledger = Ledger(1)

        def settle(self):
            self.settled += 1

    runtime = Runtime()
    verifier = Verifier(lambda inputs, cache=None: inputs, runtime, prefill=6)
    for shape in [
        (1, 4),
        (1, 2),
        (1, 4),
        (1, 1),
        (1, 3),
    ]:  # the prompt's 6 tokens in two chunks, then verifies (one with nothing drafted: plain decode)
        verifier(mx.zeros(shape))
    assert runtime.settled == 1 and runtime.ledger.verifying
    assert (runtime.ledger.verify_passes, runtime.ledger.drafted) == (2, 3 + 2)


def test_stats_show_the_acceptance_rate_and_experts_per_token(capsys):
    code = main(
        ["generate", "--prompt", "def add(a, b):", "--max-tokens", "12", "--capacity", "0.25", "--stats"]
        + ["--ignore-chat-template", "--draft-model", str(od_moe.DEFAULT_MODEL), "--num-draft-tokens", "2"]
    )
    err = capsys.readouterr().err
    assert code == 0
    line = next(line for line in err.splitlines() if line.startswith("decode: "))
    assert "experts read per generated token; drafts: " in line and "acceptance rate" in line
    stats = {
        "experts_per_token": 2.5,
        "moved_as": "read in place plus copied",
        "drafts": {"verify_passes": 0, "drafted": 0, "accepted": 0, "acceptance_rate": None},
    }
    assert decode_line(stats) == "decode: 2.50 experts read in place plus copied per generated token"


def test_the_prompt_cache_keeps_what_a_target_and_its_draft_both_hold():
    target, _ = _stock()
    draft, _ = _stock(od_moe.DEFAULT_DRAFT)
    caches = make_prompt_cache(target) + make_prompt_cache(draft)
    for i, c in enumerate(caches):
        n = 7 if i < len(target.layers) else 6
        c.update_and_fetch(mx.zeros((1, 4, n, 48)), mx.zeros((1, 4, n, 48)))
    kept = PromptCache()
    kept.keep(caches, list(range(9)))
    assert kept.tokens == list(range(6)) and {c.offset for c in caches} == {6}


def test_the_server_drafts_every_request_one_at_a_time(stock):
    engine = od_moe.load(capacity=0.25)
    app = create_app(engine, max_batch=4, draft_model=str(od_moe.DEFAULT_MODEL), num_draft_tokens=K)
    worker = app.worker
    assert worker.max_batch == 1 and worker.batch is None
    assert worker.batch_cut == "batching is off with a draft model: one request at a time (--max-batch 4)"
    client = app.test_client()
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    ref = _reference(stock, stock[3], PROMPTS[1], max_tokens=16)
    first = client.post("/v1/completions", json=body).get_json()
    assert first["choices"][0]["text"] == stock[1].decode([t for t, _ in ref])
    again = client.post("/v1/completions", json=dict(body, num_draft_tokens=1)).get_json()  # cache reused
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for bad in [{"draft_model": "other"}, {"num_draft_tokens": -1}, {"num_draft_tokens": "3"}]:
        r = client.post("/v1/completions", json=dict(body, **bad))
        assert r.status_code == 400 and r.get_json()["error"]["param"] in bad
    assert client.post("/v1/completions", json=dict(body, draft_model="default_model")).status_code == 200
    health = client.get("/health").get_json()
    drafts = health["drafts"]
    assert drafts["model"] == str(od_moe.DEFAULT_MODEL) and drafts["num_draft_tokens"] == K
    assert drafts["verify_passes"] > 0 and 0.9 < drafts["acceptance_rate"] <= 1
    assert health["expert_cache_stats"]["experts_per_token"] is not None
    metrics = client.get("/metrics").get_data(as_text=True)
    assert f"od_moe_draft_accepted_tokens_total {float(drafts['accepted'])!r}" in metrics
    assert "od_moe_draft_acceptance_rate " in metrics and "od_moe_decode_experts_per_token " in metrics
    page = client.get("/dashboard/data").get_json()
    assert page["drafts"] == drafts and page["decode"]["experts_per_token"] is not None
    worker.shutdown()
    engine.close()


def test_a_server_without_a_draft_refuses_one_per_request():
    engine = od_moe.load(capacity=0.25)
    app = create_app(engine, max_batch=1)
    r = app.test_client().post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "draft_model": "d"})
    assert r.status_code == 400 and "without --draft-model" in r.get_json()["error"]["message"]
    assert app.test_client().get("/health").get_json()["drafts"]["model"] is None
    app.worker.shutdown()
    engine.close()


def test_a_copied_model_folder_drafts_like_its_original(tmp_path, stock):
    """A draft folder elsewhere (the bundled model copied) loads and drafts as the bundled one does."""
    copy = tmp_path / "copy"
    shutil.copytree(od_moe.DEFAULT_MODEL, copy)
    engine = od_moe.load(capacity=1.0, two_tier=True)
    got = engine.stream_generate(PROMPTS[2], max_tokens=12, draft_model=str(copy), num_draft_tokens=K)
    assert [(r.token, r.from_draft) for r in got] == _reference(stock, stock[3], PROMPTS[2], max_tokens=12)
    engine.close()


def test_the_servers_warm_up_drafts_as_its_requests_will(monkeypatch):
    """`serve`'s loader loads the draft and warms up with it (verify passes), then forgets the figures; the
    worker finds the draft loaded."""
    from od_moe import engine as engine_module
    from od_moe.server.drafting import ServerDraft
    from od_moe.server.warm_up import warmed_loader

    seen = []
    reset = engine_module.Engine.reset_stats
    monkeypatch.setattr(
        engine_module.Engine, "reset_stats", lambda self: seen.append(self.stats()["drafts"]) or reset(self)
    )
    drafting, warmed = ServerDraft(str(od_moe.DEFAULT_MODEL), K), []
    engine = warmed_loader(None, 1, {"capacity": 0.25}, warmed, drafting)()
    assert drafting.draft is not None and len(warmed) == 1 and warmed[0] > 0
    assert seen[-1]["verify_passes"] > 0  # the warm-up drafted, and its counts were then reset
    assert engine.stats()["drafts"]["verify_passes"] == 0
    drafting.load(engine)  # the worker's call: the draft is already there
    engine.close()


CODE_EDIT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "# the same functions, again\ndef add(a, b):\n"
)


def test_prompt_lookup_finds_the_latest_earlier_run_and_rewinds():
    from od_moe.generation.prompt_lookup import History

    history = History([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert history.next_token() == 4  # the longest run first: 1 2 3 was followed by 4
    history = History([7, 2, 3, 4, 9, 2, 3, 5, 8, 2, 3])
    assert history.next_token() == 5  # no 8 2 3 before; of the 2 3 runs, the latest: 2 3 5
    history = History([1, 2, 3, 4, 1, 2])
    assert history.next_token() == 3
    history.extend([4, 1, 2])
    assert history.trim(3) == 3 and history.tokens == [1, 2, 3, 4, 1, 2] and history.next_token() == 3
    history = History([5, 6, 7])
    assert history.next_token() == 7  # nothing seen before: the last token again
    assert history.trim(2) == 2 and history.tokens == [5] and history.trim(5) == 1 and history.offset == 0


def test_prompt_lookup_visits_earlier_places_as_a_scan_of_every_token_would():
    """The index of where each token occurs gives what a scan of every earlier position gives, through
    random extends and rewinds."""
    import random

    from od_moe.generation.prompt_lookup import History

    def scanned(tokens, ngram=3):
        for n in range(min(ngram, len(tokens) - 1), 0, -1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tokens[-n:]:
                    return tokens[start + n]
        return tokens[-1]

    rng, history = random.Random(0), History()
    for _ in range(400):
        if history.offset and rng.random() < 0.3:
            history.trim(rng.randint(1, 4))
        else:
            history.extend(rng.randint(0, 5) for _ in range(rng.randint(1, 3)))
        if history.offset:
            assert history.next_token() == scanned(history.tokens)


def _lookup_reference(stock, prompt: list[int], max_tokens: int, k: int = K, **kwargs):
    """Stock mlx-lm's model (every expert resident) through prompt lookup's loop: the same passes."""
    from od_moe.generation.prompt_lookup import LookupCounts, stream_lookup

    counts = LookupCounts()
    stream = stream_lookup(stock[0], stock[1], prompt, max_tokens, counts, num_draft_tokens=k, **kwargs)
    return [(r.token, r.from_draft) for r in stream], counts


@pytest.mark.parametrize("two_tier", [False, True], ids=["per-layer", "two-tier"])
def test_prompt_lookup_equals_stock_fed_the_same_drafts(stock, two_tier):
    """Prompt lookup (`PromptLookup`, no second model): od-moe's tokens are stock mlx-lm's undrafted greedy
    tokens, and with their `from_draft` flags equal stock's model run through the same lookup loop, at every
    capacity on both paths; on a prompt the answer repeats, most tokens come from drafts, and the ledger
    counts what the loop drafted."""
    undrafted = None
    for capacity in CAPACITIES:
        engine = od_moe.load(capacity=capacity, two_tier=two_tier)
        prompt = engine.encode(CODE_EDIT)
        if undrafted is None:
            undrafted = [r.token for r in mlx_lm_stream_generate(stock[0], stock[1], prompt, max_tokens=32)]
        reference, counts = _lookup_reference(stock, prompt, 32)
        lookup = od_moe.PromptLookup()
        stream = engine.stream_generate(CODE_EDIT, max_tokens=32, draft_model=lookup, num_draft_tokens=K)
        got = [(r.token, r.from_draft) for r in stream]
        assert [t for t, _ in got] == undrafted, capacity
        assert got == reference, capacity
        drafts = engine.stats()["drafts"]
        assert drafts["accepted"] == sum(f for _, f in reference) > len(reference) // 2
        assert drafts["drafted"] == sum(lookup.counts.drafted.values()) == sum(counts.drafted.values())
        assert drafts["verify_passes"] == lookup.counts.drafting_passes < len(reference) // 2
        found = drafts["found_in"]  # by where the drafts were found: in the prompt, in the answer so far
        assert found["prompt"]["drafted"] > 0 and found == {
            source: {"drafted": lookup.counts.drafted[source], "accepted": lookup.counts.accepted[source]}
            for source in ("prompt", "output")
        }
        assert sum(f["drafted"] for f in found.values()) == drafts["drafted"]
        assert sum(f["accepted"] for f in found.values()) == drafts["accepted"]


@pytest.mark.parametrize("two_tier", [False, True], ids=["per-layer", "two-tier"])
def test_prompt_lookup_gives_undrafted_greedy_tokens(stock, two_tier):
    """On prompts of code whose answers take some drafts (not the code-edit prompt's, which takes most), the
    tokens with prompt lookup are stock mlx-lm's greedy tokens with no drafting: the reference is code
    od-moe did not write, and the drafts accepted (checked) are where the loop could depart from it. A loop
    that kept one rejected draft's cache entry gave the same-loop reference's tokens and failed here."""
    engine = od_moe.load(capacity=0.25, two_tier=two_tier)
    for prompt in (PROMPTS[0], PROMPTS[2]):
        tokens = engine.encode(prompt)
        undrafted = [r.token for r in mlx_lm_stream_generate(stock[0], stock[1], tokens, max_tokens=32)]
        before = engine.stats()["drafts"]["accepted"]
        got = engine.stream_generate(
            prompt, max_tokens=32, draft_model=od_moe.PromptLookup(), num_draft_tokens=K
        )
        assert [r.token for r in got] == undrafted, prompt
        assert engine.stats()["drafts"]["accepted"] > before, prompt
    engine.close()


def test_the_lookup_loop_drafts_only_what_it_finds(stock):
    """A pass drafts the tokens that followed the latest earlier run (at most k), none where nothing
    matched, and knows whether it found them in the prompt or in the answer; with nothing to find, the loop
    decodes one position a pass, as undrafted generation does, and gives its tokens."""
    from od_moe.generation.prompt_lookup import History

    history = History([1, 2, 3, 4, 5, 9, 1, 2])
    history.prompt_end = 6
    assert history.continuation(2) == ([], False)  # by default only a run of 3 tokens drafts
    assert history.continuation(2, shortest=2) == ([3, 4], True)
    assert history.continuation(9, shortest=1) == ([3, 4, 5, 9, 1, 2], True)
    history.extend([3, 7, 8, 1, 2, 3])
    assert history.continuation(3) == ([7, 8, 1], False)  # the latest run of 1 2 3 is in the answer
    assert History([5, 6, 7]).continuation(3, shortest=1) == ([], False) and history.continuation(0) == (
        [],
        False,
    )
    target, tokenizer = stock[0], stock[1]
    prompt = [1, 2, 3]  # no token repeats: the first passes find nothing
    plain = [r.token for r in mlx_lm_stream_generate(target, tokenizer, prompt, max_tokens=4)]
    found, counts = _lookup_reference(stock, prompt, 4)
    assert [t for t, _ in found] == plain
    first = 0 if plain[0] in prompt else 1  # a pass drafts once its last token was seen before
    assert counts.passes == 4 - sum(f for _, f in found) and counts.drafting_passes <= 4 - first


def test_sampling_with_prompt_lookup_keeps_the_target_s_distribution(stock):
    """At a drafted position a sampled token follows the target's distribution, not the draft: with a fixed
    seed per sample, the draft's frequency over 400 samples is the target's probability of it (within four
    standard deviations), which a loop that kept drafts it should have resampled would miss. An engine given
    the same seed samples the same tokens as stock's model through the same loop."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from od_moe.generation.prompt_lookup import History, LookupCounts, lookup_generate_step
    from od_moe.generation.sampling import make_sampler

    target = stock[0]
    engine = od_moe.load(capacity=0.25)
    prompt = engine.encode(CODE_EDIT)
    draft = History(prompt).continuation(1)[0][0]
    logits = target(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    temperature = next(t for t in (1.0, 1.5, 2.0, 3.0, 5.0) if mx.softmax(logits / t)[draft].item() < 0.8)
    p = mx.softmax(logits / temperature)[draft].item()
    samples = 400
    # the prompt but its last token computed once: each sample starts from a copy of its caches (the
    # loop prefills the same tokens the same way), and draws from there
    prefilled = make_prompt_cache(target)
    target(mx.array(prompt[:-1])[None], cache=prefilled)
    mx.eval([c.state for c in prefilled])
    firsts = []
    for seed in range(samples):
        sampler = make_sampler(temperature, seed=seed)
        cache = make_prompt_cache(target)
        for c, done in zip(cache, prefilled):
            c.state = done.state
        steps = lookup_generate_step(
            mx.array(prompt[-1:]),
            target,
            max_tokens=2,
            num_draft_tokens=1,
            sampler=sampler,
            counts=LookupCounts(),
            prompt_cache=[*cache, History(prompt[:-1])],
        )
        firsts.append(next(steps)[0])
    frequency, sigma = firsts.count(draft) / samples, np.sqrt(p * (1 - p) / samples)
    assert 0.05 < p < 0.8 and abs(frequency - p) < 4 * sigma, (frequency, p)
    reference, _ = _lookup_reference(stock, prompt, 16, sampler=make_sampler(temperature, seed=7))
    stream = engine.stream_generate(
        CODE_EDIT,
        max_tokens=16,
        temperature=temperature,
        seed=7,
        draft_model=od_moe.PromptLookup(),
        num_draft_tokens=K,
    )
    assert [(r.token, r.from_draft) for r in stream] == reference


def test_prompt_lookup_from_the_command_line(capsys):
    assert main(["generate", "--prompt", CODE_EDIT, "--max-tokens", "16", "--prompt-lookup", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "acceptance rate" in err and "found in the prompt " in err and ", in the answer " in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--prompt-lookup", "--draft-model", str(od_moe.DEFAULT_MODEL)])
    assert e.value.code == 2 and "give --draft-model or --prompt-lookup, not both" in capsys.readouterr().err
