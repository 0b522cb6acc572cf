"""Lab (issue #57): how far any prompt lookup could cut the experts read per generated token on the committed
code-edit prompts, with the bundled model, on this CPU (not product code). Deterministic counts, no timing.

od-moe's lookup loop (`prompt_lookup.lookup_generate_step`) is run with a `PromptLookup` whose
`continuation` is an oracle that knows the target's undrafted greedy tokens T for the prompt:
- `lookup`: the longest prefix (up to k) of T's next tokens that occurs anywhere in the text so far (prompt
  and answer): what the best possible lookup, which can only copy runs of earlier text, would draft;
- `perfect`: T's next k tokens whatever they are (every draft accepted where the verify pass agrees with
  undrafted decoding): the ceiling of any draft, a draft model's included.
Per kind and k, over the 6 prompts, at one capacity (two tiers on this CPU: reads in place plus copies):
accepted/drafted, generated tokens per target pass, and experts per generated token drafted over
undrafted (the sum over prompts of each).

    python3 lab/drafts/lookup_ceiling.py [CAPACITY] [K,K,...]
"""

import sys

import od_moe

sys.path.insert(0, "benchmarks")
from code_edits import prompts as code_edit_prompts  # noqa: E402

N = 64


def occurs(tokens: list[int], run: list[int]) -> bool:
    n = len(run)
    return any(tokens[i : i + n] == run for i in range(len(tokens) - n + 1))


class Oracle(od_moe.PromptLookup):
    """A prompt lookup that drafts from `truth` (the answer's tokens) as `kind` says."""

    def __init__(self, truth: list[int], prompt_len: int, kind: str):
        super().__init__()
        self.truth, self.prompt_len, self.kind = truth, prompt_len, kind

    def continuation(self, history, count):
        done = len(history.tokens) - self.prompt_len  # answer tokens in the history (the last one included)
        ahead = self.truth[done : done + count]
        if self.kind == "lookup":
            while ahead and not occurs(history.tokens, ahead):
                ahead = ahead[:-1]
        in_prompt = bool(ahead) and occurs(history.tokens[: self.prompt_len], ahead)
        return ahead, in_prompt


def main():
    capacity = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
    ks = [int(k) for k in (sys.argv[2] if len(sys.argv) > 2 else "3,8").split(",")]
    engine = od_moe.load(capacity=capacity, two_tier=True)
    prompts = code_edit_prompts()
    truths, plain = [], 0.0
    for prompt in prompts:
        engine.reset_stats()
        truths.append([r.token for r in engine.stream_generate(prompt, max_tokens=N)])
        plain += engine.stats()["experts_per_token"]
    print(
        f"capacity {capacity}, {len(prompts)} prompts x {N} tokens, undrafted: {plain / len(prompts):.2f} "
        "experts a generated token"
    )
    print(
        "| drafts | k | accepted | tokens a pass | equal undrafted | experts a token, drafted / undrafted |"
    )
    print("|---|---|---|---|---|---|")
    for kind in ("lookup", "perfect"):
        for k in ks:
            drafted = accepted = passes = generated = same = 0
            experts = 0.0
            for prompt, truth in zip(prompts, truths):
                prompt_len = len(engine.tokenizer.encode(prompt))
                lookup = Oracle(truth, prompt_len, kind)
                engine.reset_stats()
                got = [
                    r.token
                    for r in engine.stream_generate(
                        prompt, max_tokens=N, draft_model=lookup, num_draft_tokens=k
                    )
                ]
                experts += engine.stats()["experts_per_token"]
                counts = lookup.counts
                drafted += sum(counts.drafted.values())
                accepted += sum(counts.accepted.values())
                passes += counts.passes
                generated += len(got)
                same += got == truth
            print(
                f"| {kind} | {k} | {accepted}/{drafted} | {generated / passes:.2f} "
                f"| {same}/{len(prompts)} | {experts / plain:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
