"""The wheel carries what an installed jaxsample reads at run time: the named
configs (`--config vote` without a checkout) and the CPU kernels' C++ sources.

Built from a copy of the project's files under a temporary directory (pip
builds in the source tree), then read from the unpacked wheel in a process that
never sees this checkout (`python -S`: no editable-install finder).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for name in ("jaxsample", "models", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = out.glob("jaxsample-*.whl")
    return whl


def test_the_wheel_holds_the_named_configs_and_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert configs and {f"jaxsample/configs/{n}" for n in configs} <= names
    kernels = {p.name for p in (ROOT / "models" / "cpu_kernels").glob("cpu_*.*")
               if p.suffix in (".cc", ".h")}
    assert len(kernels) >= 4 and {f"jaxsample/models/cpu_kernels/{n}" for n in kernels} <= names
    # every module of models/ and its subpackages (pyproject's packages list)
    modules = {"jaxsample/models/" + p.relative_to(ROOT / "models").as_posix()
               for p in (ROOT / "models").rglob("*.py")}
    assert len(modules) > 20 and modules <= names, sorted(modules - names)


def test_a_named_config_resolves_from_the_installed_wheel(wheel, tmp_path):
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; sys.path += sys.argv[2:];"
            "from jaxsample.cli.config import CONFIG_DIR, load_config;"
            "assert str(CONFIG_DIR).startswith(sys.argv[1]), CONFIG_DIR;"
            "print(load_config('vote').reducer.kind)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    p = subprocess.run([sys.executable, "-S", "-c", code, str(unpacked), *site.getsitepackages()],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "vote"
