"""Packaging: a regular (non-editable) install carries predictor/ and training/ as od_moe.predictor and
od_moe.training, with the embedded model and the bundled text, and imports with no path edits."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_regular_wheel_installs_the_mapped_packages(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("od_moe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "od_moe/engine.py",
        "od_moe/predictor/model.py",
        "od_moe/training/record.py",
        "od_moe/models/tiny-qwen3-moe-4bit/model.safetensors",
        "od_moe/models/tiny-qwen3-moe-4bit-predictor/predictor.safetensors",
        "od_moe/training/data/python_source.jsonl.gz",
        "od_moe/server/static/dashboard.js",
    ):
        assert expected in names
    assert not any(n.startswith(("predictor/", "training/")) for n in names)  # never top-level names
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import od_moe, od_moe.predictor, od_moe.training.record, od_moe.server; "
        "print(od_moe.__file__); print(od_moe.predictor.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"},
    )
    assert run.returncode == 0, run.stderr
    assert all(line.startswith(str(target)) for line in run.stdout.split())


def test_python_m_od_moe_runs_in_the_checkout_after_a_regular_install(tmp_path):
    """The quick start runs `python3 -m od_moe` in the checkout after `pip install .`: the checkout's own
    od_moe/ folder comes first on sys.path there, and it has no predictor/ or training/ inside."""
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-t",
            target,
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    # -S: no site-packages .pth files, so no editable install's finder maps the folders for us
    deps = [p for p in sys.path if p.endswith("site-packages")]
    argv = ["generate", "--prompt", "import os", "--max-tokens", "4", "--capacity", "25%", "--stats"]
    run = subprocess.run(
        [sys.executable, "-S", "-m", "od_moe", *argv, "--predictor", "bundled", "--ignore-chat-template"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": os.pathsep.join([str(target), *deps]), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    assert "prefetch predictor:" in run.stderr  # od_moe.predictor was imported and used


def test_a_skipped_test_says_why_in_the_suites_summary(tmp_path):
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\n@pytest.mark.skip(reason='needs a thing this machine lacks')\n"
        "def test_x():\n    pass\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-c",
            ROOT / "pyproject.toml",
            "--rootdir",
            tmp_path,
            "-n",
            "0",
        ]
        + [tmp_path / "test_one.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "SKIPPED [1]" in run.stdout and "needs a thing this machine lacks" in run.stdout, run.stdout


def test_each_quick_start_line_stands_on_its_own():
    """A newcomer may paste the second line into a new terminal: each line makes or reuses `.venv` and
    activates it before it installs, and `.ci/run` runs each line in a fresh shell of its own."""
    root = Path(__file__).resolve().parent.parent
    block = (root / "README.md").read_text().split("## Quick start", 1)[1].split("```bash\n", 1)[1]
    lines = block.split("```", 1)[0].strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("python3 -m venv .venv && . .venv/bin/activate && "), line
    ci = (root / ".ci" / "run").read_text()
    assert 'bash -euo pipefail -c "$line"' in ci and 'bash -euo pipefail -c "$quick_start"' not in ci
