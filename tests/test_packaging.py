"""Packaging: a regular (non-editable) install carries predictor/ and training/ as od_moe.predictor and
od_moe.training, with the embedded model and the bundled text, and imports with no path edits; the wheel
leaves MLX's backend to an extra (cpu, cuda12, cuda13), and where MLX has none that runs, the `od-moe`
command and `import od_moe` say in one line which to install."""

import email
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from od_moe.memory import backend

ROOT = Path(__file__).resolve().parents[1]
LINUX = {"sys_platform": "linux", "platform_system": "Linux"}
MACOS = {"sys_platform": "darwin", "platform_system": "Darwin"}
BACKEND_EXTRAS = {"cpu": "mlx-cpu", "cuda12": "mlx-cuda-12", "cuda13": "mlx-cuda-13"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
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
            str(dist),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (path,) = dist.glob("od_moe-*.whl")
    return path


def test_a_regular_wheel_installs_the_mapped_packages(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "od_moe/engine.py",
        "od_moe/predictor/model.py",
        "od_moe/training/record.py",
        "od_moe/models/tiny-qwen3-moe-4bit/model.safetensors",
        "od_moe/models/tiny-qwen3-moe-4bit-predictor/predictor.safetensors",
        "od_moe/training/data/python_source.jsonl.gz",
        "od_moe/server/static/dashboard.js",
        "od_moe/per_layer/per_layer_runtime.py",
        "od_moe/two_tier/kernels.py",
        "od_moe/distributed/rank_split.py",
    ):
        assert expected in names
    # every module of every folder (pyproject lists each package: a folder it misses is not installed)
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "od_moe").rglob("*.py")}
    assert sorted(modules - names) == []
    assert not any(n.startswith(("predictor/", "training/")) for n in names)  # never top-level names
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import od_moe, od_moe.predictor, od_moe.training.record, od_moe.server, "
        "od_moe.per_layer.per_layer_runtime, "
        "od_moe.two_tier.two_tier_runtime, od_moe.distributed.rank_split; "
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


def _requirements(wheel) -> tuple[list[str], list[Requirement]]:
    """The wheel's declared extras and requirements, from its METADATA."""
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(z.read(name))
    return meta.get_all("Provides-Extra"), [Requirement(r) for r in meta.get_all("Requires-Dist")]


def _applies(requirement: Requirement, platform: dict, extra: str = "") -> bool:
    return requirement.marker is None or requirement.marker.evaluate({**platform, "extra": extra})


def test_the_wheel_leaves_mlxs_backend_to_one_extra_each(wheel):
    extras, requirements = _requirements(wheel)
    assert set(BACKEND_EXTRAS) <= set(extras)
    mlx_range = SpecifierSet(">=0.32,<0.33")
    for platform in (LINUX, MACOS):
        plain = [r for r in requirements if r.name == "mlx" and _applies(r, platform)]
        assert [(r.extras, r.specifier) for r in plain] == [(set(), mlx_range)]  # no backend by default
    assert not [r for r in requirements if r.name.startswith("mlx-cpu") or r.name.startswith("mlx-cuda")]
    for extra in BACKEND_EXTRAS:
        wanted = [r for r in requirements if r.extras and _applies(r, LINUX, extra) and r.name == "mlx"]
        assert [(r.extras, r.specifier) for r in wanted] == [({extra}, mlx_range)]
    # the test extra pulls no backend: beside a CUDA one (`.[cuda13,test]`) a CPU one overwrites libmlx.so
    test = [r for r in requirements if _applies(r, LINUX, "test") and not _applies(r, LINUX)]
    assert test and not [r for r in test if r.name.startswith("mlx")]


def test_mlxs_own_extras_name_its_backends_for_linux_only():
    """od-moe's extras forward to mlx's, whose markers keep the backends off macOS (Metal comes with plain
    mlx there): `pip install 'od-moe[cpu]'` on a Mac installs what plain od-moe does."""
    requirements = [Requirement(r) for r in importlib.metadata.requires("mlx")]
    for extra, package in BACKEND_EXTRAS.items():
        (backend_req,) = [r for r in requirements if r.name == package and _applies(r, LINUX, extra)]
        assert str(backend_req.specifier) == f"=={importlib.metadata.version('mlx')}"
        assert not _applies(backend_req, MACOS, extra) and not _applies(backend_req, LINUX)


# What `import mlx.core` raises on Linux with plain mlx and no backend package (MLX 0.32.4): its extension
# module links libmlx.so, which only mlx-cpu or mlx-cuda-* installs.
NO_LIBMLX = ImportError("libmlx.so: cannot open shared object file: No such file or directory")


@pytest.mark.parametrize(
    "driver, extra",
    [
        (None, "cpu"),
        (11080, "cpu"),
        (12020, "cuda12"),
        (12090, "cuda12"),
        (13000, "cuda13"),
        (13020, "cuda13"),
    ],
)
def test_no_backend_names_the_extra_for_this_machines_gpu(monkeypatch, driver, extra):
    monkeypatch.setattr(backend, "cuda_driver_version", lambda: driver)
    monkeypatch.setattr(backend, "_installed", lambda package: None)
    advice = backend.missing_backend(NO_LIBMLX)
    assert f"pip install 'od-moe[{extra}]'" in advice and "\n" not in advice
    if driver is not None:
        assert f"CUDA {driver // 1000}.{driver % 1000 // 10}" in advice


def test_a_backend_whose_files_are_gone_or_without_a_driver_says_what_to_do(monkeypatch):
    monkeypatch.setattr(backend, "_installed", lambda package: "0.32.4" if package == "mlx-cuda-13" else None)
    advice = backend.missing_backend(NO_LIBMLX)  # another backend's uninstall took the shared file
    assert advice.endswith("pip install --force-reinstall --no-deps 'mlx-cuda-13==0.32.4'")
    no_driver = ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
    assert backend.missing_backend(no_driver).endswith(
        "pip uninstall -y mlx-cuda-13 && pip install 'od-moe[cpu]'"
    )
    assert backend.missing_backend(ImportError("numpy.core.multiarray failed to import")) is None


@pytest.fixture
def no_backend(tmp_path):
    """An environment for a subprocess in which MLX has no backend, failing as for real: a folder ahead of
    site-packages holding MLX's extension module without the libmlx.so beside it (mlx is a namespace
    package, so its other modules still come from site-packages), and a sitecustomize that hides the
    installed backend package from importlib.metadata."""
    if sys.platform != "linux":
        pytest.skip("MLX's backend is a package of its own on Linux only (plain mlx brings Metal on macOS)")
    site = tmp_path / "no-backend"
    (site / "mlx").mkdir(parents=True)
    shutil.copy(mx.__file__, site / "mlx")
    (site / "sitecustomize.py").write_text(
        "import importlib.metadata as metadata\n\n_version = metadata.version\n\n\n"
        "def version(name):\n"
        "    if name.startswith(('mlx-cpu', 'mlx-cuda')):\n"
        "        raise metadata.PackageNotFoundError(name)\n"
        "    return _version(name)\n\n\n"
        "metadata.version = version\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    check = subprocess.run(
        [sys.executable, "-c", "import mlx.core"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "libmlx.so: cannot open shared object file" in check.stderr, check.stderr  # the real failure
    extra, _ = backend.extra_for_this_machine()
    return env, f"pip install 'od-moe[{extra}]'"


@pytest.mark.parametrize("command", ["python -m od_moe", "od-moe"])
def test_the_command_without_a_backend_says_which_extra_in_one_line(no_backend, tmp_path, command):
    env, advice = no_backend
    script = Path(sys.executable).parent / "od-moe"  # the console script pip wrote for this environment
    if command == "od-moe" and not script.exists():
        pytest.skip(f"no od-moe script beside {sys.executable}: od-moe is not installed in this environment")
    argv = [sys.executable, "-m", "od_moe"] if command != "od-moe" else [sys.executable, str(script)]
    run = subprocess.run(
        [*argv, "generate", "--prompt", "x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and not run.stdout
    (line,) = run.stderr.splitlines()
    assert line.startswith("od-moe: error: MLX has no backend installed: ") and advice in line


def test_import_od_moe_without_a_backend_raises_an_import_error_naming_the_extra(no_backend, tmp_path):
    env, advice = no_backend
    code = "try:\n    import od_moe\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    assert line.startswith("MLX has no backend installed: ") and advice in line
