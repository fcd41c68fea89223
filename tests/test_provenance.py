"""Provenance names this package's own source: never the commit of the directory it is run from."""

import os
import shlex
import shutil
import subprocess
import sys
import types

import pytest

from affdiv import provenance, reporting

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _repo(path):
    """A git repository at ``path`` with one commit; returns its HEAD."""
    path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **GIT_ENV}
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "--allow-empty", "-m", "user's project"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, env=env)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_run_from_another_repository_does_not_record_its_commit(tmp_path, monkeypatch):
    user_commit = _repo(tmp_path / "project")
    monkeypatch.chdir(tmp_path / "project")
    record = provenance.provenance()
    assert record["git_commit"] != user_commit
    assert user_commit not in reporting.to_json(record)
    assert record["version"] and {"git_commit", "git_dirty", "git_source"} <= set(record)


def test_same_in_a_fresh_interpreter(tmp_path):
    """The whole record, from a process whose working directory is the user's repository."""
    user_commit = _repo(tmp_path / "project")
    done = subprocess.run([sys.executable, "-c", "from affdiv.provenance import provenance; import json; "
                           "print(json.dumps(provenance()))"], cwd=tmp_path / "project", capture_output=True,
                          text=True, check=True)
    assert user_commit not in done.stdout


def test_checkout_state_only_for_the_top_of_a_checkout(tmp_path):
    commit = _repo(tmp_path / "repo")
    assert provenance.checkout_state(tmp_path / "repo") == {"git_commit": commit, "git_dirty": False}
    (tmp_path / "repo" / "new.py").write_text("x = 1\n")
    assert provenance.checkout_state(tmp_path / "repo")["git_dirty"] is True
    # a package folder inside someone else's repository (site-packages in a project's venv)
    (tmp_path / "repo" / "site-packages" / "affdiv").mkdir(parents=True)
    assert provenance.checkout_state(tmp_path / "repo" / "site-packages" / "affdiv") == {
        "git_commit": None, "git_dirty": None}
    assert provenance.checkout_state(tmp_path / "not-a-repo") == {"git_commit": None, "git_dirty": None}


def test_an_installed_copy_reports_the_commit_it_was_built_from(monkeypatch):
    monkeypatch.setattr(provenance, "checkout_state", lambda root=None: {"git_commit": None, "git_dirty": None})
    built = types.ModuleType("affdiv._build_info")
    built.GIT_COMMIT, built.GIT_DIRTY = "b" * 40, False
    monkeypatch.setitem(sys.modules, "affdiv._build_info", built)
    assert provenance.source_state() == {"git_commit": "b" * 40, "git_dirty": False, "git_source": "build"}
    built.GIT_COMMIT = None  # built from an sdist: nothing known
    assert provenance.source_state() == {"git_commit": None, "git_dirty": None, "git_source": None}
    monkeypatch.setitem(sys.modules, "affdiv._build_info", None)  # no build record at all
    assert provenance.source_state()["git_source"] is None


def test_no_git_gives_no_commit_and_ignores_the_environment(monkeypatch):
    def no_git(*args, **kwargs):
        raise OSError("git not found")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setitem(sys.modules, "affdiv._build_info", None)
    monkeypatch.setenv("AFFDIV_GIT_COMMIT", "abc123")  # no longer read: it named whatever the caller said
    assert provenance.source_state() == {"git_commit": None, "git_dirty": None, "git_source": None}


def test_the_command_names_no_absolute_path(tmp_path, monkeypatch):
    out = tmp_path / "reports" / "study"
    argv = ["/somewhere/bin/affdiv", "falsify", "--preset", "smoke", "--out", str(out), f"--db={tmp_path / 'r.sqlite'}",
            "--data-dir", "data/fashion", "--set", f"data_dir={tmp_path / 'data'}"]
    # Absolute paths as if typed in the working directory, like the relative ones.
    assert provenance.command_line(argv, tmp_path) == ("affdiv falsify --preset smoke --out reports/study "
                                                       "--db=r.sqlite --data-dir data/fashion --set data_dir=data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", argv)
    record = provenance.provenance()
    assert record["command"].startswith("affdiv falsify --preset smoke --out reports/study")
    assert str(tmp_path) not in record["command"]
    assert provenance.relative_path(tmp_path / "x.csv", out) == "../../x.csv"
    assert provenance.relative_path("rel/x.csv", out) == "rel/x.csv"
    # A path outside the working directory is written as its file name; a script keeps its name.
    script = [str(tmp_path / "benchmarks" / "bench.py"), "--json", "/elsewhere/out/b.json", "--in=/elsewhere/a.csv"]
    assert provenance.command_line(script, tmp_path) == "python benchmarks/bench.py --json b.json --in=a.csv"
    assert provenance.command_line(["/x/affdiv/__main__.py", "verify"], tmp_path) == "affdiv verify"
    # quoted as a shell reads it: the line runs as written
    argv = ["/x/bin/affdiv", "falsify", "--passes", "MKL on Intel", "--set", 'lr_rule="sqrt"']
    line = provenance.command_line(argv, tmp_path)
    assert line == """affdiv falsify --passes 'MKL on Intel' --set 'lr_rule="sqrt"'"""
    assert shlex.split(line)[1:] == argv[1:]


def test_the_vendor_is_read_from_cpuinfo(tmp_path):
    from affdiv.provenance import cpu_vendor

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_vendor(str(info)) == "AuthenticAMD"
    info.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # (an ARM processor names none)
    assert cpu_vendor(str(info)) is None
    info.write_text("vendor_id\t:\n")
    assert cpu_vendor(str(info)) is None
    assert cpu_vendor(str(tmp_path / "absent")) is None


def test_torchs_blas_is_read_from_its_build_configuration():
    from affdiv.provenance import torch_blas

    settings = "  - Build settings: BLAS_INFO={}, BUILD_TYPE=Release, LAPACK_INFO=mkl,\n"
    assert torch_blas("PyTorch built with:\n" + settings.format("mkl")) == "mkl"
    assert torch_blas(settings.format("open")) == "open"
    assert torch_blas(settings.format("")) is None
    assert torch_blas("  - Build settings: BUILD_TYPE=Release, LAPACK_INFO=mkl\n") is None  # (no BLAS named)
    assert torch_blas("  - Build settings: XBLAS_INFO=mkl\n") is None


def test_the_record_names_the_processors_vendor(monkeypatch):
    from affdiv import provenance as module

    monkeypatch.setattr(module, "cpu_vendor", lambda: "GenuineIntel")
    assert module.provenance()["cpu_vendor"] == "GenuineIntel"


def test_the_machine_of_a_run_on_a_gpu_names_the_gpu_and_cuda(monkeypatch):
    import torch

    from affdiv.provenance import cpu_identity, machine_identity

    asked = []

    def name(device):
        asked.append(device)
        return "SomeGPU"

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine_identity("cpu") == machine_identity() == machine_identity("mps") == cpu_identity()
    assert not asked  # (a CPU run asks nothing of CUDA)
    with pytest.raises(ValueError, match=r"^device 'cuda:1': CUDA is not available here"):
        machine_identity("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert machine_identity("cuda:1") == {**cpu_identity(), "gpu": "SomeGPU", "gpu_capability": "8.6", "cuda": "12.8",
                                          "cudnn": 91002}
    assert asked == [torch.device("cuda:1")]
    monkeypatch.setattr(torch.version, "hip", "6.2")  # (ROCm: HIP's version in CUDA's place)
    assert machine_identity("cuda")["hip"] == "6.2" and "cuda" not in machine_identity("cuda")
