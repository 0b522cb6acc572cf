"""The `od-moe` command line: `generate`, `serve`, `bench`, `train-predictor`, `eval-predictor`,
`inspect` and `pack`.

User mistakes (a bad flag, path or value) print one line `od-moe: error: ...` and exit with code 2; an
expert that cannot be read while generating (the model's files changed) prints one line and exits with 1.
"""

import argparse
import sys

from .errors import ExpertReadError, UserError


def _capacity_arg(parser: argparse.ArgumentParser):
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--capacity",
        help="experts resident per MoE layer: a count (16), a fraction (0.25) or 25%% (default: what the "
        "memory budget holds)",
    )
    group.add_argument(
        "--memory-budget", help="memory for the whole engine, e.g. 8GB or 512MiB (default: 70%% of available)"
    )


def _direct_io_arg(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--direct-io",
        choices=["auto", "on", "off"],
        default="auto",
        help="read experts past the OS page cache (default auto: when the model is larger than memory)",
    )


def _two_tier_arg(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--two-tier",
        choices=["auto", "on", "off"],
        default="auto",
        help="every expert in host memory, read in place on a miss, --capacity experts per layer in device "
        "slots (default auto: on CUDA where host memory holds the experts)",
    )


def _direct_io(value: str):
    return {"auto": "auto", "on": True, "off": False}[value]


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows every flag's default: written into its help where that says more, else appended."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="od-moe", description="Run Mixture-of-Experts models larger than memory."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_SubParser)

    gen = sub.add_parser("generate", help="stream a completion of a prompt")
    gen.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    gen.add_argument(
        "--prompt",
        required=True,
        help="text to continue, or '-' to read it from standard input (as mlx-lm's generate)",
    )
    gen.add_argument(
        "--system-prompt", help="a system message before the prompt (with the chat template only)"
    )
    gen.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="continue the raw prompt (by default, as mlx-lm's generate does, the prompt goes into the "
        "tokenizer's chat template as a user message when the tokenizer has one)",
    )
    gen.add_argument(
        "--chat-template-config",
        metavar="JSON",
        help="further arguments for the chat template, a JSON object (e.g. '{\"enable_thinking\": false}')",
    )
    gen.add_argument("--max-tokens", type=int, default=256, help="the most tokens to generate")
    _capacity_arg(gen)
    _direct_io_arg(gen)
    _two_tier_arg(gen)
    gen.add_argument(
        "--miss-policy",
        choices=["load", "skip"],
        default="load",
        help="load: exact, read missing experts before use; skip: approximate, drop them",
    )
    gen.add_argument(
        "--eviction",
        choices=["lru", "lfu"],
        default="lru",
        help="which resident expert a read replaces: least recently or least frequently used",
    )
    gen.add_argument(
        "--predictor",
        help="a shadow predictor folder (train-predictor's --out); 'bundled' for the embedded model's",
    )
    gen.add_argument(
        "--prefetch",
        choices=["none", "profile", "next-gate", "predictor", "oracle"],
        help="what drives prefetching (default: predictor with --predictor, else none); oracle "
        "first generates once to record the true routing, then replays it (an upper bound)",
    )
    gen.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    gen.add_argument("--seed", type=int, help="random seed for sampling, 0 to 2**63 - 1")
    gen.add_argument("--snapshot", help="warm-start from a snapshot folder saved for this model and capacity")
    gen.add_argument("--save-snapshot", help="after generating, save the resident set to this folder")
    gen.add_argument("--stats", action="store_true", help="print cache statistics after the text")

    srv = sub.add_parser("serve", help="serve OpenAI-compatible completions and chat over HTTP, with /health")
    srv.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    srv.add_argument(
        "--predictor",
        help="a shadow predictor folder written by train-predictor ('bundled': the embedded model's)",
    )
    srv.add_argument(
        "--prefetch",
        choices=["none", "profile", "next-gate", "predictor"],
        help="what drives prefetching (default: predictor with --predictor, else none)",
    )
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; anything else is your choice to expose it)",
    )
    srv.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    _capacity_arg(srv)
    _direct_io_arg(srv)
    _two_tier_arg(srv)
    srv.add_argument(
        "--max-tokens",
        type=int,
        help="the most tokens one request may ask for (default: the model's maximum positions; every "
        "generation stops where prompt and completion fill them)",
    )
    srv.add_argument(
        "--max-input-tokens",
        type=int,
        help="the longest prompt accepted, in tokens (default: one less than the model's maximum positions)",
    )
    srv.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a further name the Host header may carry (repeatable; default: the --host address, and the "
        "loopback names when bound to loopback)",
    )
    srv.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (https://example.org, or *) whose pages may call the server (repeatable; "
        "default: none, browser requests from other origins are refused)",
    )

    bench = sub.add_parser("bench", help="measure speed, memory, hit rate and reads against stock mlx-lm")
    from .bench.cli import add_arguments

    add_arguments(bench)

    train = sub.add_parser(
        "train-predictor", help="record routing traces, train the shadow predictor, report its accuracy"
    )
    train.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    train.add_argument(
        "--data",
        help=(
            "text/JSON lines/parquet file, a folder of them, or a hub dataset (default: bundled Python "
            "source)"
        ),
    )
    train.add_argument(
        "--text-field", default="text", help="the column holding the text in JSON/parquet/CSV data"
    )
    train.add_argument(
        "--eval-data", help="held-out text to report on (default: 10%% of --data's documents, held out)"
    )
    train.add_argument(
        "--out",
        default="od-moe-predictor",
        help="folder for the predictor and report.json (default: ./od-moe-predictor)",
    )
    train.add_argument(
        "--lookahead", type=int, default=4, help="predict the experts of this many layers ahead"
    )
    train.add_argument(
        "--max-tokens", type=int, default=200_000, help="training tokens to record (default 200000)"
    )
    train.add_argument(
        "--eval-tokens", type=int, default=16384, help="held-out tokens to record (default 16384)"
    )
    train.add_argument(
        "--epochs",
        type=int,
        default=3,
        help="passes over the training traces, for the shadow network and its next-use head alike",
    )
    train.add_argument(
        "--rank",
        type=int,
        default=80,
        help="width of the predictor trunk (default 80: under 5%% of the expert bytes here)",
    )
    train.add_argument(
        "--depth",
        type=int,
        default=1,
        help="trunk layers (default 1; more add residual layers of width --rank)",
    )
    train.add_argument("--batch-size", type=int, default=512)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument(
        "--traces", help="folder to record traces into and reuse (default: DIR/traces, removed after)"
    )
    train.add_argument("--keep-traces", action="store_true", help="keep OUT/traces after training")
    train.add_argument("--json", action="store_true", help="print report.json instead of the tables")
    _capacity_arg(train)

    ev = sub.add_parser("eval-predictor", help="report a predictor's accuracy and the baselines on any text")
    ev.add_argument("--model", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    ev.add_argument(
        "--predictor",
        required=True,
        help="folder written by train-predictor ('bundled': the embedded model's)",
    )
    ev.add_argument(
        "--data", required=True, help="text/JSON lines/parquet file, a folder of them, or a hub dataset"
    )
    ev.add_argument("--text-field", default="text")
    ev.add_argument(
        "--max-tokens", type=int, default=16384, help="tokens to record and evaluate (default 16384)"
    )
    ev.add_argument("--json", action="store_true", help="print the report as JSON")
    _capacity_arg(ev)

    pk = sub.add_parser(
        "pack", help="write a copy of the experts with each expert contiguous: one read per expert"
    )
    pk.add_argument("model", nargs="?", help="model folder (default: the embedded tiny Qwen3-MoE)")
    pk.add_argument(
        "--out",
        help="the packed file to write (default: MODEL/od-moe-packed/experts.safetensors, which load() "
        "finds; elsewhere, pass its path as load(packed=...))",
    )

    ins = sub.add_parser("inspect", help="what loading a model would do, without loading its weights")
    ins.add_argument("model", nargs="?", help="model folder or hub id (default: the embedded tiny Qwen3-MoE)")
    ins.add_argument(
        "--memory-budget", help="the budget whose capacity to report (default: 70%% of available)"
    )
    ins.add_argument("--capacity", help="experts per layer (16, 0.25 or 25%%) whose memory budget to report")
    ins.add_argument("--predictor", help="a predictor folder to check (default: one beside the model)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


class _SubParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_DefaultsFormatter, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("od-moe")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _check_writable(folder: str):
    """Fail before any work when a snapshot could not be saved to `folder`."""
    import tempfile
    from pathlib import Path

    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UserError(f"cannot save a snapshot to {path} ({e.strerror}): choose a writable folder")


def _check_positive(parser, name, value):
    if value is not None and value < 1:
        parser.error(f"{name} must be a positive integer, got {value}")


def _pick(args, *names) -> dict:
    """The parsed arguments `names` as keyword arguments."""
    return {name: getattr(args, name) for name in names}


def _predictor_arg(value):
    if value == "bundled":
        from .engine import DEFAULT_PREDICTOR

        return DEFAULT_PREDICTOR
    return value


def _read_prompt(args) -> str:
    """The prompt text: '-' reads standard input; escapes as mlx-lm's generate reads them."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise UserError("prompt is empty: give some text to continue")
    return prompt


def _template_options(args) -> dict:
    """The chat template's further arguments (`--chat-template-config`), checked before the model loads."""
    import json

    if args.chat_template_config is None:
        return {}
    try:
        options = json.loads(args.chat_template_config)
    except ValueError as e:
        options = e
    if not isinstance(options, dict):
        raise UserError(
            f"--chat-template-config must be a JSON object such as '{{\"enable_thinking\": false}}', got "
            f"{args.chat_template_config!r}"
        )
    return options


def _chat_prompt(tokenizer, prompt: str, args, options: dict) -> str:
    """`prompt` put into the tokenizer's chat template as mlx-lm's generate puts it, unless the tokenizer
    has none or `--ignore-chat-template` is given."""
    if args.ignore_chat_template or not getattr(tokenizer, "has_chat_template", False):
        return prompt
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    except TypeError as e:  # an option the template's renderer does not take
        raise UserError(f"the chat template refused --chat-template-config: {e}")


def cmd_generate(args):
    from . import load
    from .report import format_stats
    from .sampling import check_sampling

    options = dict(
        _pick(args, "capacity", "memory_budget", "miss_policy", "eviction"),
        direct_io=_direct_io(args.direct_io),
        two_tier=_direct_io(args.two_tier),  # the same auto/on/off
    )
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed)
    check_sampling(args.temp, args.top_p, seed=args.seed)  # before the model loads
    prompt, template = _read_prompt(args), _template_options(args)
    if args.save_snapshot:
        _check_writable(args.save_snapshot)
    oracle = args.prefetch == "oracle"
    engine = load(
        args.model,
        snapshot=args.snapshot,
        predictor=_predictor_arg(args.predictor),
        prefetch="none" if oracle else args.prefetch,
        **options,
    )
    prompt = _chat_prompt(engine.tokenizer, prompt, args, template)
    if oracle:  # the routing of this very generation, recorded by a scratch engine with the same settings
        engine.configure_prefetch("oracle", load(args.model, **options).record_routing(prompt, **sampling))
    for response in engine.stream_generate(prompt, **sampling):
        print(response.text, end="", flush=True)
    print()
    if response.finish_reason == "length" and response.generation_tokens < args.max_tokens:
        print(
            f"od-moe: stopped after {response.generation_tokens} tokens: prompt and completion fill the "
            f"model's {engine.max_positions} positions",
            file=sys.stderr,
        )
    if args.save_snapshot:
        engine.save_snapshot(args.save_snapshot)
    if args.stats:
        print(format_stats(engine.stats(), response), file=sys.stderr)


def _print_report(report: dict, as_json: bool):
    import json

    from .training.report import format_report

    print(json.dumps(report, indent=1) if as_json else format_report(report))


def cmd_train_predictor(args):
    from .training.pipeline import train_predictor_job

    names = (
        "model",
        "data",
        "text_field",
        "eval_data",
        "out",
        "lookahead",
        "rank",
        "depth",
        "max_tokens",
        "eval_tokens",
        "epochs",
        "batch_size",
        "lr",
        "capacity",
        "memory_budget",
        "keep_traces",
    )
    report = train_predictor_job(traces_dir=args.traces, **_pick(args, *names))
    _print_report(report, args.json)
    if not args.json:
        print(f"\npredictor and report.json written to {args.out}")


def cmd_eval_predictor(args):
    from .training.pipeline import eval_predictor_job

    names = ("model", "text_field", "max_tokens", "capacity", "memory_budget")
    report = eval_predictor_job(_predictor_arg(args.predictor), args.data, **_pick(args, *names))
    _print_report(report, args.json)


def cmd_serve(args):
    from .server import serve

    names = (
        "model",
        "prefetch",
        "host",
        "port",
        "capacity",
        "memory_budget",
        "max_tokens",
        "max_input_tokens",
        "allow_host",
        "allow_origin",
    )
    picked = _pick(args, *names)
    picked["allow_hosts"], picked["allow_origins"] = picked.pop("allow_host"), picked.pop("allow_origin")
    serve(
        predictor=_predictor_arg(args.predictor),
        direct_io=_direct_io(args.direct_io),
        two_tier=_direct_io(args.two_tier),
        log=lambda line: print(line, file=sys.stderr, flush=True),
        **picked,
    )


def cmd_inspect(args):
    import json

    from .preflight import format_inspection, inspect_model

    report = inspect_model(args.model, args.memory_budget, args.capacity, _predictor_arg(args.predictor))
    print(json.dumps(report, indent=1) if args.json else format_inspection(report))


def cmd_pack(args):
    from .engine import model_layouts
    from .packed import pack
    from .progress import byte_progress
    from .units import format_bytes

    store, layouts = model_layouts(args.model)
    total = sum(layout.num_experts * layout.expert_nbytes for layout in layouts)
    with byte_progress("packing experts", total) as bar:
        out = pack(store, layouts, args.out, progress=bar.update)
    print(f"packed the experts of {len(layouts)} MoE blocks ({format_bytes(total)}) into {out}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "serve"):
        _check_positive(parser, "--max-tokens", args.max_tokens)
    if args.command == "serve":
        _check_positive(parser, "--max-input-tokens", args.max_input_tokens)
        if not 0 <= args.port < 65536:
            parser.error(f"--port must be 0 to 65535, got {args.port}")
    if args.command in ("train-predictor", "eval-predictor"):
        for name in ("max_tokens", "eval_tokens", "epochs", "rank", "depth", "batch_size"):
            _check_positive(parser, "--" + name.replace("_", "-"), getattr(args, name, None))
        if getattr(args, "lr", 1.0) <= 0:
            parser.error(f"--lr must be positive, got {args.lr}")
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "serve":
            cmd_serve(args)
        elif args.command == "train-predictor":
            cmd_train_predictor(args)
        elif args.command == "eval-predictor":
            cmd_eval_predictor(args)
        elif args.command == "inspect":
            cmd_inspect(args)
        elif args.command == "pack":
            cmd_pack(args)
        elif args.command == "bench":
            from .bench.cli import run

            run(args)
    except UserError as e:
        print(f"od-moe: error: {e}", file=sys.stderr)
        return 2
    except ExpertReadError as e:  # the model's files changed under a running command
        print(f"od-moe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
