"""The `od-moe` command line: `generate`, `serve`, `bench`, `train-predictor`, `eval-predictor`,
`inspect` and `pack`.

User mistakes (a bad flag, path or value) print one line `od-moe: error: ...` and exit with code 2; an
expert that cannot be read while generating (the model's files changed), another rank of a pipeline
gone, or a server that could not get ready, prints one line and exits with 1.
"""

import sys

from .arguments import build_parser
from .errors import ExpertReadError, RankLost, StartFailed, UserError


def _direct_io(value: str):
    """auto/on/off as `load` takes it (for --direct-io and --two-tier)."""
    return {"auto": "auto", "on": True, "off": False, "lru": "lru"}[value]


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


def _packed(args):
    """--packed FILE as `load` takes it: the file, else "auto" (the model folder's packed experts)."""
    return args.packed if args.packed is not None else "auto"


def _draft(args):
    """--draft-model or --prompt-lookup as `load` and `serve` take them: a model folder or hub id (the
    embedded draft's folder for 'bundled'), a `PromptLookup`, or None."""
    if args.prompt_lookup:
        from .generation.prompt_lookup import PromptLookup

        return PromptLookup()
    if args.draft_model == "bundled":
        from .storage.model_files import DEFAULT_DRAFT

        return str(DEFAULT_DRAFT)
    return args.draft_model


def _predictor_arg(value):
    if value == "bundled":
        from .engine import DEFAULT_PREDICTOR

        return DEFAULT_PREDICTOR
    return value


def _check_utf8(text: str, where: str):
    """Refuse text that came from bytes which are not UTF-8: Python hands them over as lone surrogates,
    which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) & 0xFF
        raise UserError(
            f"the text from {where} is not valid UTF-8 (byte 0x{byte:02x} at character {e.start}): "
            "give UTF-8 text, e.g. convert it with iconv"
        )


def _read_prompt(args) -> str:
    """The prompt text: '-' reads standard input; escapes as mlx-lm's generate reads them."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise UserError("prompt is empty: give some text to continue")
    _check_utf8(prompt, "standard input" if args.prompt == "-" else "--prompt")
    if args.system_prompt is not None:
        _check_utf8(args.system_prompt, "--system-prompt")
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
    if args.ignore_chat_template:
        return prompt
    if not tokenizer.has_chat_template:
        if args.system_prompt is not None:
            print(
                "od-moe: the model's tokenizer has no chat template: the prompt is continued as text and "
                "--system-prompt is not used",
                file=sys.stderr,
            )
        return prompt
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    except TypeError as e:  # an option the template's renderer does not take
        raise UserError(f"the chat template refused --chat-template-config: {e}")


def cmd_generate(args):
    from . import load
    from .accounting.report import format_stats
    from .distributed.rank_split import rank_lines
    from .generation.sampling import OPENAI_MAX_TEMPERATURE, check_sampling

    options = dict(
        _pick(args, "capacity", "memory_budget", "miss_policy", "eviction"),
        direct_io=_direct_io(args.direct_io),
        two_tier=_direct_io(args.two_tier),  # the same auto/on/off
        packed=_packed(args),
        device_memory=args.device_memory,
        context_tokens=args.context_tokens,
    )
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed)
    draft = _draft(args)
    if draft is not None:  # speculative decoding (`generation/drafts.py`), the oracle's recording too
        sampling.update(draft_model=draft, num_draft_tokens=args.num_draft_tokens)
    # before the model loads; the temperature in OpenAI's range, as the server's OpenAI routes take it
    check_sampling(args.temp, args.top_p, seed=args.seed, max_temperature=OPENAI_MAX_TEMPERATURE)
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
    if engine.capacity_choice and not sys.stderr.isatty():  # `load` said it where a terminal watches
        print(f"od-moe: {engine.capacity_choice}", file=sys.stderr)
    if args.miss_policy == "skip" and engine.capacity < engine.num_experts:
        print(
            "od-moe: --miss-policy skip is approximate: an expert that is not resident is left out of its "
            "token's sum, so the text is not the model's (--miss-policy load is exact)",
            file=sys.stderr,
        )
    if str(args.capacity).strip() == "1":  # a count, where a reader of 1.0 or 100% may have meant all
        print(
            f"od-moe: --capacity 1 keeps 1 of {engine.num_experts} experts a layer resident (a count; 1.0 or "
            "100% keeps them all)",
            file=sys.stderr,
        )
    prompt = _chat_prompt(engine.tokenizer, prompt, args, template)
    if oracle:  # the routing of this very generation, recorded by a scratch engine with the same settings
        engine.configure_prefetch("oracle", load(args.model, **options).record_routing(prompt, **sampling))
    shown = engine.stage is None or engine.stage.rank == 0  # across ranks, rank 0 prints; the rest follow
    for response in engine.stream_generate(prompt, **sampling):
        if shown:
            print(response.text, end="", flush=True)
    ranks = engine.stage is not None and args.stats and rank_lines(engine)  # every rank takes part
    if not shown:
        return
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
        for line in ranks or ():
            print(line, file=sys.stderr)


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
        "device_memory",
        "context_tokens",
        "max_tokens",
        "max_input_tokens",
        "max_batch",
        "schedule_log",
        "allow_host",
        "allow_origin",
        "num_draft_tokens",
    )
    picked = _pick(args, *names)
    picked["draft_model"] = _draft(args)
    picked["allow_hosts"], picked["allow_origins"] = picked.pop("allow_host"), picked.pop("allow_origin")
    serve(
        predictor=_predictor_arg(args.predictor),
        direct_io=_direct_io(args.direct_io),
        two_tier=_direct_io(args.two_tier),
        packed=_packed(args),
        log=lambda line: print(line, file=sys.stderr, flush=True),
        **picked,
    )


def cmd_inspect(args):
    import json

    from .preflight import format_inspection, inspect_model

    if args.ranks < 1:
        raise UserError(f"--ranks must be a positive integer, got {args.ranks}")
    predictor = _predictor_arg(args.predictor)
    device = dict(device_memory=args.device_memory, context_tokens=args.context_tokens)
    report = inspect_model(
        args.model,
        args.memory_budget,
        args.capacity,
        predictor,
        ranks=args.ranks,
        packed=_packed(args),
        **device,
    )
    print(json.dumps(report, indent=1) if args.json else format_inspection(report))
    if report["memory_budget"].get("error"):  # the report says what would fit; the exit code says it won't
        raise UserError(report["memory_budget"]["error"])


def cmd_pack(args):
    from .engine import model_layouts
    from .progress import byte_progress
    from .storage.packed import pack
    from .units import format_bytes

    if args.model is None and args.out is None:  # the embedded model's folder is inside the installed package
        raise UserError(
            "the embedded model lives inside the installed package, which pack does not write into: give "
            "--out FILE, then pass --packed FILE to generate, serve or bench"
        )
    store, layouts = model_layouts(args.model)
    total = sum(layout.num_experts * layout.expert_nbytes for layout in layouts)
    with byte_progress("packing experts", total) as bar:
        out = pack(store, layouts, args.out, progress=bar.update)
    print(f"packed the experts of {len(layouts)} MoE blocks ({format_bytes(total)}) into {out}")


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = parser.commands[args.command]  # its mistakes name its own --help
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("generate", "serve"):
        _check_positive(command, "--max-tokens", args.max_tokens)
        if args.num_draft_tokens < 0:
            command.error(f"--num-draft-tokens must be 0 or more, got {args.num_draft_tokens}")
        if args.prompt_lookup and args.draft_model is not None:
            command.error("give --draft-model or --prompt-lookup, not both")
    if args.command in ("generate", "serve", "inspect"):
        _check_positive(command, "--context-tokens", args.context_tokens)
    if args.command == "serve":
        _check_positive(command, "--max-input-tokens", args.max_input_tokens)
        _check_positive(command, "--max-batch", args.max_batch)
        if not 0 <= args.port < 65536:
            command.error(f"--port must be 0 to 65535, got {args.port}")
    if args.command in ("train-predictor", "eval-predictor"):
        for name in ("max_tokens", "eval_tokens", "epochs", "rank", "depth", "batch_size"):
            _check_positive(command, "--" + name.replace("_", "-"), getattr(args, name, None))
        if getattr(args, "lr", 1.0) <= 0:
            command.error(f"--lr must be positive, got {args.lr}")
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
    except (ExpertReadError, RankLost, StartFailed) as e:  # files changed, a rank gone, serve never ready
        print(f"od-moe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


EXIT_WATCHDOG_S = 30.0


def run(command=None, watchdog_s: float = EXIT_WATCHDOG_S):
    """The `od-moe` process: `command` (default `main`), then an exit that cannot hang. Once the command is
    done (a server shut down: its generation thread stopped, the engine closed), a process still alive
    `watchdog_s` later prints every thread's stack and exits with 1. The interpreter's teardown waits on
    threads and native libraries' pools, and a test's server once outlived SIGTERM by 120 s after saying it
    was shutting down (tests/test_batch_server.py; cause not found). Not in `main`, which tests call in
    their own process."""
    import faulthandler

    code = (command or main)()
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    sys.exit(code)


if __name__ == "__main__":
    run()
