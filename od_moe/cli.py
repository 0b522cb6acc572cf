"""The `od-moe` command line: `generate` and `bench` (more subcommands join as they are built).

User mistakes (a bad flag, path or value) print one line `od-moe: error: ...` and exit with code 2.
"""

import argparse
import sys

from .errors import UserError


def _capacity_arg(parser: argparse.ArgumentParser):
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--capacity", help="experts resident per MoE layer: a count (16), a fraction (0.25) or 25%%")
    group.add_argument("--memory-budget", help="memory for the whole engine, e.g. 8GB or 512MiB (default: 70%% of available)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="od-moe", description="Run Mixture-of-Experts models larger than memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="stream a completion of a prompt")
    gen.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-tokens", type=int, default=256)
    _capacity_arg(gen)
    gen.add_argument("--miss-policy", choices=["load", "skip"], default="load",
                     help="load: exact, read missing experts before use; skip: approximate, drop them")
    gen.add_argument("--eviction", choices=["lru", "lfu"], default="lru")
    gen.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--snapshot", help="warm-start from a snapshot folder saved for this model and capacity")
    gen.add_argument("--save-snapshot", help="after generating, save the resident set to this folder")
    gen.add_argument("--stats", action="store_true", help="print cache statistics after the text")

    bench = sub.add_parser("bench", help="measure speed, memory, hit rate and reads against stock mlx-lm")
    from .bench.cli import add_arguments

    add_arguments(bench)
    return parser


def _check_positive(parser, name, value):
    if value is not None and value < 1:
        parser.error(f"{name} must be a positive integer, got {value}")


def cmd_generate(args):
    from . import load
    from .report import format_stats

    engine = load(args.model, capacity=args.capacity, memory_budget=args.memory_budget,
                  miss_policy=args.miss_policy, eviction=args.eviction, snapshot=args.snapshot)
    for response in engine.stream_generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temp,
                                           top_p=args.top_p, seed=args.seed):
        print(response.text, end="", flush=True)
    print()
    if args.save_snapshot:
        engine.save_snapshot(args.save_snapshot)
    if args.stats:
        print(format_stats(engine.stats(), response), file=sys.stderr)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        _check_positive(parser, "--max-tokens", args.max_tokens)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "bench":
            from .bench.cli import run

            run(args)
    except UserError as e:
        print(f"od-moe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
