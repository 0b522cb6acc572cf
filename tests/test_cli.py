"""The od-moe command line: generation, stats, and one-line errors with exit code 2."""

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import od_moe
from od_moe.cli import build_parser, main
from tiny_models import LLAMA, write_mlx_model


def test_generate_streams_text_and_stats(capsys):
    assert (
        main(
            [
                "generate",
                "--prompt",
                "def fibonacci(n):",
                "--ignore-chat-template",
                "--max-tokens",
                "16",
                "--capacity",
                "25%",
                "--predictor",
                "bundled",
                "--stats",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out.strip()
    assert "capacity 16/64" in err and "hit rate" in err and "| all" in err
    assert re.search(r"^prefetch predictor: \d+ experts read ahead .* \(precision [0-9.]+\)", err, re.M), err
    # passes and tokens apart: 16 tokens given out took 17 decode passes (mlx-lm computes one ahead)
    assert "model ran 8 prefill positions (the prompt but its last token" in err, err
    assert "which the first decode pass takes) and 17 decode passes for 16 generated tokens" in err, err
    assert "prompt 9 tokens at " in err  # the 8 positions and the first pass's token
    assert "generation 16 tokens" in err
    # one unit convention (decimal), and a back-off count that reads as English and says what it is
    assert "| MB read |" in err and "MiB" not in err and "KiB" not in err
    assert re.search(r"(no back-offs|, 1 back-off \(|, (\d{2,}|[02-9]) back-offs \()the governor", err), err


def test_console_script_runs_on_the_embedded_default():
    done = subprocess.run(
        [sys.executable, "-m", "od_moe.cli", "generate", "--prompt", "import os", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "x", "--model", "/no/such/dir"], "does not exist"),
        (["generate", "--prompt", "x", "--capacity", "0"], "capacity must be between 1 and 64"),
        (["generate", "--prompt", "x", "--capacity", "65"], "capacity must be between 1 and 64"),
        (["generate", "--prompt", "x", "--capacity", "lots"], "cannot read capacity"),
        (["generate", "--prompt", "x", "--capacity", "200%"], "give a percentage in (0%, 100%]"),
        (["generate", "--prompt", "x", "--capacity", "150%"], "give a percentage in (0%, 100%]"),
        (["generate", "--prompt", "x", "--memory-budget", "1KB"], "too small"),
        (["generate", "--prompt", "x", "--memory-budget", "plenty"], "cannot read memory size"),
        (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["generate", "--prompt", "x", "--temp", "-1"], "temperature"),
        (["generate", "--prompt", "x", "--miss-policy", "maybe"], "invalid choice"),
        (["generate", "--prompt", "x", "--frobnicate"], "unrecognized arguments"),
        (["generate"], "--prompt"),
        (["generate", "--prompt", ""], "prompt is empty"),
        (["serve", "--port", "70000"], "--port must be 0 to 65535"),
        (["serve", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["serve", "--model", "/no/such/dir"], "does not exist"),
        (["serve", "--predictor", "/no/such/dir"], "not a predictor folder"),
        (["serve", "--port", "0", "--schedule-log", "/no/such/dir/log"], "cannot write the schedule log"),
        (["serve", "--port", "0", "--max-batch", "1", "--schedule-log", "x"], "needs --max-batch 2 or more"),
        (["bench", "--predictor", "/no/such/dir"], "not a predictor folder"),
        # bytes that are not UTF-8 in argv reach Python as lone surrogates (os.fsdecode)
        (
            ["generate", "--prompt", "def f(x):\udcff"],
            "--prompt is not valid UTF-8 (byte 0xff at character 9)",
        ),
        (["generate", "--prompt", "x", "--system-prompt", "\udcfe"], "--system-prompt is not valid UTF-8"),
        (["pack"], "the embedded model lives inside the installed package"),
        # the command line's own words, not only the Python API's
        (["generate", "--prompt", "x", "--prefetch", "predictor"], "give --predictor DIR ('bundled'"),
        (
            ["generate", "--prompt", "x", "--snapshot", "/"],
            "save one with `od-moe generate --save-snapshot DIR`",
        ),
        (
            ["generate", "--prompt", "x", "--predictor", "/"],
            "that `od-moe train-predictor --out` wrote, or 'bundled'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_model_without_moe_layers_is_refused(tmp_path, capsys):
    path = write_mlx_model(tmp_path / "llama", LLAMA)
    assert main(["generate", "--prompt", "x", "--model", str(path)]) == 2
    assert "no Mixture-of-Experts layer" in capsys.readouterr().err


def test_folder_without_config_is_refused(tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_a_process_that_outlives_its_command_says_where_it_waits_and_exits():
    """`od-moe`'s process (`cli.run`): a teardown still waiting (here on a thread that never ends) after the
    watchdog's seconds prints every thread's stack and exits with 1, never hangs; a clean one exits at once
    with the command's code."""
    hangs = (
        "import threading, time; from od_moe.cli import run; "
        "run(lambda: (threading.Thread(target=time.sleep, args=(600,), name='stuck').start(), 0)[1], 1.0)"
    )
    done = subprocess.run([sys.executable, "-c", hangs], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Timeout (0:00:01)!" in done.stderr, done.stderr
    # every thread: the stuck one, and the main thread waiting for it in the interpreter's teardown
    assert done.stderr.count("(most recent call first)") == 2 and "in _shutdown" in done.stderr
    clean = "from od_moe.cli import run; run(lambda: 3, 60.0)"
    done = subprocess.run([sys.executable, "-c", clean], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and not done.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and re.fullmatch(r"od-moe \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_readme_synopsis_lists_every_flag_of_every_command():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```", 2)[1]
    documented, command = {}, None
    for line in block.splitlines():
        if line.startswith("od-moe "):
            command = line.split()[1]
        documented.setdefault(command, set()).update(re.findall(r"--[a-z][a-z-]*", line))
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert "--version" in documented["--version"]
    for name, sub in commands.choices.items():
        flags = {f for a in sub._actions for f in a.option_strings if f.startswith("--") and f != "--help"}
        assert flags == documented.get(name), (name, flags ^ documented.get(name, set()))


def _commands():
    (commands,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    return commands.choices.items()


@pytest.mark.parametrize(
    "name", ["generate", "serve", "train-predictor", "eval-predictor", "bench", "inspect"]
)
def test_help_shows_every_default(name):
    sub = dict(_commands())[name]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or action.default is None or action.default is False:
            continue
        if action.default == "==SUPPRESS==":
            continue
        assert "default" in formatter._get_help_string(action), (name, action.option_strings)
    text = " ".join(sub.format_help().split())  # argparse wraps lines
    if name == "generate":
        assert "(default: 256)" in text and "(default: lru)" in text and "(default: 1.0)" in text
    if name == "serve":
        assert "(default: 8080)" in text
    if name == "train-predictor":
        assert "next-use head alike (default: 3)" in text


def _generated(capsys, argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(["generate", "--max-tokens", "8", *argv]) == 0
    return capsys.readouterr().out


def test_prompt_dash_reads_standard_input(capsys, monkeypatch):
    typed = _generated(capsys, ["--prompt", "import os\n", "--ignore-chat-template"])
    piped = _generated(capsys, ["--prompt", "-", "--ignore-chat-template"], "import os\n", monkeypatch)
    assert piped == typed and piped.strip()


def test_prompt_from_standard_input_that_is_not_utf8_is_one_line(capsys, monkeypatch):
    """What `printf 'def f(x):\\xff' | od-moe generate --prompt -` hands Python: stdin decoded with
    surrogateescape, as the C and POSIX locales do."""
    stdin = io.TextIOWrapper(io.BytesIO(b"def f(x):\xff\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["generate", "--prompt", "-", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "od-moe: error: the text from standard input is not valid UTF-8 (byte 0xff at character 9): "
        "give UTF-8 text, e.g. convert it with iconv"
    ], err


def test_inspect_of_a_budget_too_small_reports_then_exits_2(capsys):
    """The report still shows what each capacity needs; the budget's line says it holds nothing, once, and
    the error (on stderr, exit 2) what it needs, so a script can tell."""
    assert main(["inspect", "--memory-budget", "1MB"]) == 2
    out, err = capsys.readouterr()
    assert "budget     1.00 MB holds no expert: too small" in out and "needs      12.5%:" in out
    assert out.count("too small") == 1
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("od-moe: error: memory budget 1.00 MB is too small"), err


def test_the_skip_policy_says_it_is_approximate(capsys):
    argv = ["generate", "--prompt", "x", "--max-tokens", "2", "--miss-policy", "skip", "--capacity"]
    assert main([*argv, "25%"]) == 0
    assert "--miss-policy skip is approximate" in capsys.readouterr().err
    assert main([*argv, "100%"]) == 0  # nothing misses: the text is the model's
    assert "approximate" not in capsys.readouterr().err


def test_capacity_1_is_said_to_be_one_expert(capsys):
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--capacity", "1"]) == 0
    assert "--capacity 1 keeps 1 of 64 experts a layer resident" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--capacity", "1.0"]) == 0
    assert "--capacity 1 keeps" not in capsys.readouterr().err


def test_the_bundled_draft_has_a_name_on_the_command_line(capsys):
    """`--draft-model bundled` is the shipped draft, as `--predictor bundled` is the shipped predictor:
    greedy text equal to undrafted greedy text."""
    plain = _generated(capsys, ["--prompt", "def add(a, b):", "--ignore-chat-template"])
    drafted = _generated(
        capsys, ["--prompt", "def add(a, b):", "--ignore-chat-template", "--draft-model", "bundled"]
    )
    assert drafted == plain and plain.strip()


def _templated_copy(tmp_path) -> Path:
    """The embedded model with a chat template in its tokenizer (links to its files, its own config)."""
    import json

    for f in od_moe.DEFAULT_MODEL.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "tokenizer_config.json").unlink()
    config = json.loads((od_moe.DEFAULT_MODEL / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'user' %}# Q: {{ m['content'] }}\n{% else %}"
        "# {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}# A:\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_chat_template_is_used_by_default_as_mlx_lm_does(capsys, tmp_path):
    model = _templated_copy(tmp_path)
    engine = od_moe.load(model)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    templated = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert templated.startswith("# be brief\n# Q: def add(a, b):")
    expect = engine.generate(templated, max_tokens=8)
    raw = engine.generate("def add(a, b):", max_tokens=8)
    assert expect != raw
    argv = ["--model", str(model), "--prompt", "def add(a, b):"]
    assert _generated(capsys, [*argv, "--system-prompt", "be brief"]) == expect + "\n"
    assert _generated(capsys, [*argv, "--ignore-chat-template"]) == raw + "\n"


def test_a_tokenizer_with_no_chat_template_continues_the_prompt(capsys):
    """The embedded model never learned a chat format: its tokenizer offers none, so `generate` continues
    the text by default (as mlx-lm's does for such a tokenizer), and a system prompt is said to be unused."""
    assert not od_moe.load().tokenizer.has_chat_template
    raw = _generated(capsys, ["--prompt", "def add(a, b):", "--ignore-chat-template"])
    assert _generated(capsys, ["--prompt", "def add(a, b):"]) == raw
    assert main(["generate", "--max-tokens", "4", "--prompt", "def f():", "--system-prompt", "be brief"]) == 0
    err = capsys.readouterr().err
    assert "no chat template" in err and "--system-prompt" in err


def test_a_chat_template_config_that_is_not_an_object_is_refused(capsys):
    assert main(["generate", "--prompt", "x", "--chat-template-config", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def _readme_usage() -> dict[str, str]:
    """Each command's usage lines in the README's "Command line" block, joined."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    usage, command = {}, None
    for line in block.splitlines():
        if line.startswith("od-moe "):
            command = line.split()[1]
        usage[command] = usage.get(command, "") + " " + line
    return usage


def test_the_readme_usage_names_every_flag_with_the_parsers_choices():
    usage = _readme_usage()
    for name, command in build_parser().commands.items():
        written = dict(re.findall(r"(--[a-z][a-z-]*)(?: ([^\s\[\]-][^\s\]]*))?", usage[name]))
        flags = {
            f for a in command._actions for f in a.option_strings if f.startswith("--") and f != "--help"
        }
        assert set(written) == flags, (name, set(written) ^ flags)
        for action in command._actions:
            if action.choices and action.option_strings:
                shown = written[action.option_strings[0]]
                assert set(shown.split("|")) == set(action.choices), (name, action.option_strings, shown)


def test_every_flag_says_what_it_does_and_its_default():
    for name, command in build_parser().commands.items():
        for action in command._actions:
            if not action.option_strings or action.required or action.option_strings == ["-h", "--help"]:
                continue
            assert action.help, (name, action.option_strings)
            takes_a_value = action.nargs != 0
            shown_default = not (action.default is None or action.default is False or action.default == [])
            if takes_a_value and not shown_default:
                assert "default" in action.help, (name, action.option_strings, action.help)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["generate", "--prompt", "x", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["serve", "--port", "70000"], "--port must be 0 to 65535"),
        (["train-predictor", "--lr", "0"], "--lr must be positive"),
        (["inspect", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_a_flag_mistake_is_one_line_naming_the_commands_help(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("od-moe: error: ") and message in err[0]
    assert err[0].endswith(f"(see 'od-moe {argv[0]} --help')")
