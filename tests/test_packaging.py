"""Packaging: a regular (non-editable) install carries predictor/ and training/ as od_moe.predictor and
od_moe.training, with the embedded model and the bundled text, and imports with no path edits."""

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
