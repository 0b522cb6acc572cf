"""The od-moe command line: generation, stats, and one-line errors with exit code 2."""

import subprocess
import sys

import pytest

from od_moe.cli import main
from tiny_models import LLAMA, write_mlx_model


def test_generate_streams_text_and_stats(capsys):
    assert (
        main(
            [
                "generate",
                "--prompt",
                "def fibonacci(n):",
                "--max-tokens",
                "16",
                "--capacity",
                "25%",
                "--stats",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out.strip()
    assert "capacity 16/64" in err and "hit rate" in err and "| all" in err


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
        (["bench", "--predictor", "/no/such/dir"], "not a predictor folder"),
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
