"""The public API of affdiv.verify carries torch's docstring skeleton (formula, Args with
defaults, Shape, Example), and every Example runs as written (doctest)."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

from affdiv import verify

# the modules of the public API (a module joins when its public objects are documented)
MODULES = ["affdiv.verify.engine", "affdiv.verify.metrics", "affdiv.verify.ntk", "affdiv.verify.checks"]
PUBLIC = [obj for obj in map(vars(verify).get, verify.__all__) if getattr(obj, "__module__", None) in MODULES]
WITHOUT_TENSORS = {verify.run_checks, verify.CheckResult}  # no Shape section


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_public_objects_have_the_torch_docstring_skeleton(obj):
    doc = inspect.getdoc(obj)
    sections = ["Args:", "Example::", ">>> "] + ([] if obj in WITHOUT_TENSORS else ["Shape:"])
    assert all(section in doc for section in sections), [s for s in sections if s not in doc]
