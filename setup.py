"""The build's two extras beyond pyproject.toml (where the metadata lives).

1. The compiled parts, both optional (without a compiler the install still succeeds and the layers
   run their Python paths; ``affdiv.layers._fused.available()`` and ``_native.available()`` tell):
   the fused CPU passes of the corrected layers (layers/_fused_cpu.c), and the layers'
   autograd nodes in C++ (layers/_autograd_nodes.cpp), which compile against torch and so are
   built by torch's ``BuildExtension``, with the torch of the build environment (pyproject.toml's
   build requirements; a build without isolation uses the installed one, which the extension then
   matches).
2. ``build_py`` with two changes. Because the package ``affdiv`` is the repository root, setuptools
   would ship every top-level ``.py`` file as a module of it: this file is left out (it must not
   install as ``affdiv.setup``). And a wheel built from a git checkout records that checkout's
   commit and dirty flag in ``affdiv/_build_info.py``, which ``affdiv.provenance`` reports
   (``git_source: "build"``) when the installed copy is not itself a checkout.
"""

import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
NOT_MODULES = {"setup"}  # top-level files of the repository that are not modules of affdiv


def _git(*args):
    try:
        done = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build_info() -> str:
    """The text of affdiv/_build_info.py: the commit this source was built from, if it is the top of
    a git checkout (else None), and whether tracked or untracked, not ignored, files differed."""
    top = _git("rev-parse", "--show-toplevel")
    commit = _git("rev-parse", "HEAD") if top is not None and Path(top).resolve() == HERE else None
    status = _git("status", "--porcelain") if commit is not None else None
    dirty = None if status is None else bool(status)
    return (
        '"""Written by setup.py when this copy was built; read by affdiv.provenance."""\n\n'
        f"GIT_COMMIT = {commit!r}\nGIT_DIRTY = {dirty!r}\n"
    )


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == "affdiv":
            modules = [m for m in modules if m[1] not in NOT_MODULES]
        return modules

    def run(self):
        super().run()
        if not self.dry_run:
            for name in NOT_MODULES:  # a copy left in build/ by an older build would still be packed
                (Path(self.build_lib) / "affdiv" / f"{name}.py").unlink(missing_ok=True)
            target = Path(self.build_lib) / "affdiv" / "_build_info.py"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(build_info())

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return [*outputs, str(Path(self.build_lib) / "affdiv" / "_build_info.py")]


def extensions() -> tuple[list, type]:
    """(the extension modules, the build_ext command): the C passes, and the C++ autograd nodes where
    torch can be imported here. torch's build_ext then builds both; of the flags it adds, only its
    C++ standard would not suit the C file, which names its own (torch adds none where one is given)."""
    fused = Extension(
        "affdiv.layers._fused_cpu",
        sources=["layers/_fused_cpu.c"],
        depends=["layers/_fused_cpu.h"],
        # (no-math-errno, for the whole file: its square roots, its one libm call, may then be
        # vectorised, with IEEE's values either way; no pass reads errno)
        extra_compile_args=["-O3", "-fno-math-errno", "-fopenmp", "-std=gnu11"],
        extra_link_args=["-fopenmp"],
        optional=True,
    )
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as error:  # (no torch, or one that fails to import: the nodes are optional)
        print(f"affdiv: not building the C++ autograd nodes (torch does not import here: {error!r}); "
              "the layers will run their Python autograd Functions", file=sys.stderr)
        return [fused], build_ext
    native = CppExtension(
        "affdiv.layers._autograd_nodes", sources=["layers/_autograd_nodes.cpp"], depends=["layers/_fused_cpu.h"],
        extra_compile_args=["-O3"], optional=True,
    )
    return [fused, native], BuildExtension.with_options(use_ninja=False)


if __name__ == "__main__":  # (setuptools runs this file as __main__; tests import BuildPy)
    ext_modules, build_ext_command = extensions()
    setup(cmdclass={"build_py": BuildPy, "build_ext": build_ext_command}, ext_modules=ext_modules)
