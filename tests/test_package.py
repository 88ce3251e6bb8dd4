"""The wheel stands alone: built from this tree, installed outside it, it has
what users need (the demo, the benchmark, the type marker, the license) and no
test-only modules at the top, and it runs and type-checks from elsewhere. The
sdist is the source tree, and its suite runs where it is extracted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the wheel, a directory it is installed into, outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
         str(ROOT)],
        check=True, capture_output=True, text=True, timeout=300, cwd=tmp,
    )
    (whl,) = (tmp / "dist").glob("kvtier-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp / "site"), str(whl)],
        check=True, capture_output=True, text=True, timeout=300, cwd=tmp,
    )
    yield whl, tmp / "site"


def run_outside(site: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a directory outside the checkout, kvtier from ``site``."""
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=site.parent, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_the_wheel_holds_the_package_its_marker_and_license_and_nothing_else(wheel: tuple[Path, Path]) -> None:
    whl, _ = wheel
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        top_level = z.read(info.replace("METADATA", "top_level.txt")).decode().split()
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvtier"} and top_level == ["kvtier"]
    for needed in ("kvtier/py.typed", "kvtier/demo.py", "kvtier/bench/__init__.py", "kvtier/bench/core.py",
                   "kvtier/testing/__init__.py", "kvtier/testing/redis_server.py", "kvtier/presets/__init__.py"):
        assert needed in names, needed
    package_root = {n for n in names if n.startswith("kvtier/") and n.count("/") == 1}
    assert not {n for n in package_root if "bench" in n or "redis" in n}, package_root  # those live in subpackages
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert f"\nVersion: {kvtier.__version__}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "kvtier = kvtier.__main__:main" in entry_points
    check_metadata(metadata)


# Checked against trove-classifiers 2026.9.21.13, the list PyPI accepts.
CLASSIFIERS = {
    "Development Status :: 3 - Alpha", "Intended Audience :: Developers", "Intended Audience :: Science/Research",
    "Operating System :: POSIX :: Linux", "Environment :: GPU :: NVIDIA CUDA", "Framework :: AsyncIO",
    "Framework :: AnyIO", "Programming Language :: Python :: 3", "Programming Language :: Python :: 3 :: Only",
    "Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12", "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Topic :: System :: Distributed Computing", "Typing :: Typed",
}


def check_metadata(metadata: str) -> None:
    """What PyPI shows: classifiers it accepts (no license classifier beside the
    SPDX expression, PEP 639), Python versions from requires-python on, the
    typing marker; no project URL that this tree cannot vouch for; structlog
    only in the dev extra (kvtier logs without it)."""
    lines = metadata.split("\n\n", 1)[0].splitlines()
    classifiers = {line.split(": ", 1)[1] for line in lines if line.startswith("Classifier: ")}
    assert classifiers == CLASSIFIERS, classifiers ^ CLASSIFIERS
    assert not any(c.startswith("License ::") for c in classifiers)
    (requires_python,) = (line.split(": ", 1)[1] for line in lines if line.startswith("Requires-Python: "))
    floor = int(requires_python.removeprefix(">=3."))
    versions = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers if c.startswith("Programming Language :: Python :: 3."))
    assert versions[0] == floor, (requires_python, versions)
    assert not [line for line in lines if line.startswith("Project-URL: ")]
    structlog = [line for line in lines if line.startswith("Requires-Dist: structlog")]
    assert structlog and all("extra == \"dev\"" in line for line in structlog), structlog


@pytest.mark.build
def test_the_installed_wheel_runs_its_demo_and_benchmark_outside_the_checkout(wheel: tuple[Path, Path]) -> None:
    _, site = wheel
    where = run_outside(site, "-c", "import kvtier; print(kvtier.__file__)")
    assert where.returncode == 0 and where.stdout.strip().startswith(str(site)), where
    for command in (("demo", "--help"), ("bench", "--help")):
        out = run_outside(site, "-m", "kvtier", *command)
        assert out.returncode == 0, (command, out.stderr[-2000:])
        assert "usage" in out.stdout.lower()
    listed = run_outside(site, "-m", "kvtier", "--help")
    assert listed.returncode == 0 and "demo" in listed.stdout and "bench" in listed.stdout, listed
    version = run_outside(site, "-m", "kvtier", "--version")
    assert version.stdout == f"kvtier {kvtier.__version__}\n", version
    demo = run_outside(site, "-m", "kvtier", "demo", "--requests", "2", "--concurrency", "2", "--storage", "file")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "every byte matched    yes" in demo.stdout
    # Nothing configured: kvtier's events stay off stdout and (no failure here) off stderr.
    assert "batch." not in demo.stdout and "batch." not in demo.stderr


@pytest.mark.build
def test_an_engines_strict_mypy_reads_kvtiers_types_from_the_wheel(wheel: tuple[Path, Path]) -> None:
    _, site = wheel
    engine = site.parent / "engine.py"
    engine.write_text(
        "from kvtier import PoolGroup, TransferScheduler\n\n\n"
        "def group_of(sched: TransferScheduler) -> PoolGroup:\n"
        "    return sched.group\n\n\n"
        "def wrong(sched: TransferScheduler) -> int:\n"
        "    return sched.group\n"
    )
    # torch's own types are skipped to keep this quick; kvtier's are what is checked.
    config = site.parent / "mypy.ini"
    config.write_text("[mypy]\nstrict = True\n[mypy-torch.*]\nfollow_imports = skip\n")
    out = run_outside(site, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(site.parent / ".mypy"),
                      str(engine), timeout=240)
    # Exactly the planted error: kvtier's annotations were read (no "missing
    # library stubs or py.typed marker"), so mypy knows `group` is a PoolGroup.
    assert "py.typed" not in out.stdout, out.stdout
    assert 'Incompatible return value type (got "PoolGroup", expected "int")' in out.stdout, out.stdout
    assert "Found 1 error in 1 file" in out.stdout, out.stdout


# -- the sdist -------------------------------------------------------------------------
#
# The sdist is the source tree (MANIFEST.in): the package and the suite with
# everything the suite reads, so that a packager's `python -m pytest` in an
# extracted sdist runs as in a checkout. An sdist that ships tests without their
# conftest.py (as setuptools' defaults did: 28 collection errors) is worse than none.

SDIST_TOP_FILES = {"CHANGELOG.md", "LICENSE", "MANIFEST.in", "Makefile", "README.md", "pyproject.toml"}
SDIST_TREES = (".ci", "benchmarks", "docs", "examples", "kvtier", "scripts", "tests")


def source_files() -> set[str]:
    """What the sdist must hold: the top files and every file of the trees here
    (bytecode and caches aside)."""
    found = set(SDIST_TOP_FILES)
    for tree in SDIST_TREES:
        for path in (ROOT / tree).rglob("*"):
            rel = path.relative_to(ROOT)
            if path.is_file() and "__pycache__" not in rel.parts and path.suffix not in (".pyc", ".pyo"):
                found.add(rel.as_posix())
    return found


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist built from this tree (setuptools, no isolation), extracted; its top directory."""
    tmp = tmp_path_factory.mktemp("sdist")
    built = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp)!r}))"],
        check=True, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    name = built.stdout.strip().splitlines()[-1]
    assert name == f"kvtier-{kvtier.__version__}.tar.gz", built.stdout
    with tarfile.open(tmp / name) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+, 3.11.4+
            tar.extractall(tmp / "x", filter="data")
        else:  # pragma: no cover - our own archive, just built
            tar.extractall(tmp / "x")  # noqa: S202
    return tmp / "x" / f"kvtier-{kvtier.__version__}"


def test_the_sdist_holds_the_source_tree_and_what_pyproject_says_travels(sdist: Path) -> None:
    held = {p.relative_to(sdist).as_posix() for p in sdist.rglob("*") if p.is_file()}
    generated = {"PKG-INFO", "setup.cfg"} | {h for h in held if h.startswith("kvtier.egg-info/")}
    assert held - generated == source_files(), (held - generated) ^ source_files()
    # pyproject's comment says the README and CHANGELOG.md travel in the sdist.
    assert "README and CHANGELOG.md travel in the sdist" in (ROOT / "pyproject.toml").read_text()
    assert (sdist / "CHANGELOG.md").read_bytes() == (ROOT / "CHANGELOG.md").read_bytes()
    assert {"tests/conftest.py", "tests/vllm/conftest.py", "tests/sglang/requirements.txt"} <= held
    for script in ("scripts/ensure-redis-server", "scripts/ensure-mooncake", ".ci/run"):
        assert os.access(sdist / script, os.X_OK), f"{script} lost its executable bit in the sdist"


@pytest.mark.build
def test_the_suite_in_an_extracted_sdist_collects_and_runs(sdist: Path) -> None:
    """Every test module of the sdist imports (against the sdist's own kvtier),
    and the checks that read the tree around the package pass there."""
    env = {**os.environ, "PYTHONPATH": str(sdist), "OMP_NUM_THREADS": "1"}
    # One run collects the whole suite (an import error in any module fails it:
    # "errors during collection", rc 2) and runs the checks that read the
    # Makefile, scripts/, docs/ and pyproject.toml around the package.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", "tests",
         "-k", "compatibility_page"],
        cwd=sdist, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    summary = ran.stdout.strip().splitlines()[-1] if ran.stdout.strip() else ""
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert re.search(r"^\d+ passed\b.* deselected", summary) and not re.search(r"failed|error", summary), summary
    where = subprocess.run([sys.executable, "-c", "import kvtier; print(kvtier.__file__)"], cwd=sdist, env=env,
                           capture_output=True, text=True, timeout=60, check=True)
    assert where.stdout.strip() == str(sdist / "kvtier" / "__init__.py")
