"""Every example in affdiv's docstrings runs and gives what it shows (doctest, in every module that
has one), and the public API of affdiv.layers and affdiv.verify carries torch's docstring skeleton
(formula, Args with defaults, Shape, Example)."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import pytest

import affdiv
from affdiv import layers, verify
from affdiv.layers import functional


def _modules_with_examples() -> list[str]:
    """The package and each of its Python modules whose source holds an example, read without importing
    the module (``affdiv.__main__`` would run the command line)."""
    found = []
    for name in ["affdiv", *(info.name for info in pkgutil.walk_packages(affdiv.__path__, "affdiv."))]:
        source = Path(importlib.util.find_spec(name).origin)  # a compiled extension: no docstrings here
        if source.suffix == ".py" and ">>> " in source.read_text("utf-8"):
            found.append(name)
    return found


# the modules of verify's public API held to the skeleton (a module joins when its public objects are documented)
VERIFY_MODULES = ["affdiv.verify.engine", "affdiv.verify.metrics", "affdiv.verify.ntk", "affdiv.verify.checks"]
PUBLIC = [getattr(layers, name) for name in layers.__all__ if name != "functional"] + [
    functional.affine_like, functional.norm_like, functional.patchnorm_conv1d, functional.patchnorm_conv2d] + [
    obj for obj in map(vars(verify).get, verify.__all__) if getattr(obj, "__module__", None) in VERIFY_MODULES]
WITHOUT_TENSORS = {layers.convert, layers.SwapRecord, verify.run_checks, verify.CheckResult}  # no Shape section


@pytest.mark.parametrize("module", _modules_with_examples())
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_public_objects_have_the_torch_docstring_skeleton(obj):
    doc = inspect.getdoc(obj)
    sections = ["Args:", "Example::", ">>> "] + ([] if obj in WITHOUT_TENSORS else ["Shape:"])
    assert all(section in doc for section in sections), [s for s in sections if s not in doc]
