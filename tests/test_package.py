"""The package as a user installs it: metadata files, extras, the modules a wheel ships, and the one-line
error naming the extra when an optional library is missing."""

import configparser
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from affdiv import _extras

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements):
    return {r.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_citable_package_files():
    assert "MIT License" in (ROOT / "LICENSE").read_text() and PYPROJECT["project"]["license"] == "MIT"
    citation = (ROOT / "CITATION.cff").read_text()
    assert "cff-version: 1.2.0" in citation and "2512.22247" in citation and "Bird" in citation
    assert f"version: \"{PYPROJECT['project']['version']}\"" in citation
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in changelog and f"## {PYPROJECT['project']['version']}" in changelog
    assert (ROOT / "py.typed").exists() and "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["affdiv"]
    assert PYPROJECT["project"]["authors"] and PYPROJECT["project"]["urls"]


def test_base_install_is_numpy_and_torch_and_extras_cover_every_optional_import():
    project = PYPROJECT["project"]
    assert _names(project["dependencies"]) == {"numpy", "torch"}
    extras = {name: _names(reqs) for name, reqs in project["optional-dependencies"].items()}
    assert {"verify", "experiments", "bench", "dask", "all", "test"} <= set(extras)
    assert extras["all"] == extras["verify"] | extras["experiments"] | extras["bench"] | extras["dask"]
    import_name = {"scikit-learn": "sklearn"}
    for extra, modules in _extras.EXTRAS.items():  # what the import-time check names is what pip installs
        installs = {import_name.get(n, n) for n in extras[extra]}
        assert set(modules) - {"mpmath"} <= installs, extra


def test_plain_tox_runs_verify_then_falsify_in_one_environment():
    """`tox` alone is the main job: its one environment runs the verify environment's commands, then the
    falsify environment's, so the two share one installation (tox 4 cannot share one environment's folder
    between two environments: it recreates it each time)."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini", encoding="utf-8")
    (main,) = tox["tox"]["env_list"].split(",")
    commands = tox[f"testenv:{main.strip()}"]["commands"].split()
    assert commands == ["{[testenv:verify]commands}", "{[testenv:falsify]commands}"]
    assert tox["testenv:verify"]["commands"].startswith("affdiv verify ")
    assert tox["testenv:falsify"]["commands"].startswith("affdiv falsify --preset smoke ")


def test_wheel_modules_leave_out_setup_py():
    """setup.py's build_py: the package is the repository root, so every top-level .py would ship as
    affdiv.<name>; setup.py must not (checked on build_py's module list, without building)."""
    from setuptools.dist import Distribution

    namespace = runpy.run_path(str(ROOT / "setup.py"), run_name="affdiv_setup")  # not __main__: no setup()
    build_py = namespace["BuildPy"]
    dist = Distribution({"package_dir": {"affdiv": str(ROOT)}, "packages": ["affdiv"]})
    # under PEP 517 (pip wheel, tox) the script is pip's backend hook, not setup.py, so distutils' own
    # "skip the setup script" rule does not apply: that is how setup.py shipped as affdiv.setup
    dist.script_name = "/pip/_in_process.py"
    command = build_py(dist)
    command.initialize_options()
    command.finalize_options()
    modules = {module for _, module, _ in command.find_package_modules("affdiv", str(ROOT))}
    assert "setup" not in modules
    assert {"__init__", "cli", "provenance", "reporting", "_extras"} <= modules
    assert "affdiv.setup" not in {f"affdiv.{m}" for m in modules}


def _import_without(module: str, blocked: str) -> subprocess.CompletedProcess:
    code = f"import sys; sys.modules[{blocked!r}] = None; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "blocked", "extra"), [
    ("affdiv.verify", "sympy", "verify"),
    ("affdiv.experiments", "statsmodels", "experiments"),
    ("affdiv.layers.benchmark", "scipy", "bench"),
    ("affdiv.experiments.runs.dask_executor", "distributed", "dask"),
])
def test_a_missing_extra_is_named_in_one_line(module, blocked, extra):
    done = _import_without(module, blocked)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("affdiv._extras.MissingExtra: ") and blocked in last
    assert f"pip install 'affdiv[{extra}]'" in last


def test_the_layers_need_no_extra():
    code = ("import sys\nfor m in ('sympy', 'scipy', 'matplotlib', 'sklearn', 'statsmodels'): sys.modules[m] = None\n"
            "import affdiv.layers, torch\n"
            "print(affdiv.layers.AffineLike(3, 2)(torch.ones(4, 3)).shape)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([4, 2])" in done.stdout


def test_require_and_missing_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sympy", None)
    message = (r"^x needs sympy, which is not installed: pip install 'affdiv\[verify\]' "
               r"\(from a checkout of affdiv: pip install --no-build-isolation -e '\.\[verify\]'\)$")
    with pytest.raises(_extras.MissingExtra, match=message):
        _extras.require("sympy", "json", extra="verify", feature="x")
    _extras.require("json", extra="verify", feature="x")
    assert isinstance(_extras.missing_extra(ModuleNotFoundError("no", name="sympy.core"), extra="verify", feature="x"),
                      _extras.MissingExtra)
    other = ModuleNotFoundError("no", name="yaml")
    assert _extras.missing_extra(other, extra="verify", feature="x") is other  # not the extra's: re-raised as is
