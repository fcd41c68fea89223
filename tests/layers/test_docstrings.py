"""The public API of affdiv.layers carries torch's docstring skeleton (formula, Args with
defaults, Shape, Example), and every Example runs as written (doctest)."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

from affdiv import layers
from affdiv.layers import functional

MODULES = ["affdiv.layers.modules", "affdiv.layers.functional", "affdiv.layers.convert"]
PUBLIC = [getattr(layers, name) for name in layers.__all__ if name != "functional"] + [
    functional.affine_like, functional.norm_like, functional.patchnorm_conv1d, functional.patchnorm_conv2d]
WITHOUT_TENSORS = {layers.convert, layers.SwapRecord}  # no Shape section


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_public_objects_have_the_torch_docstring_skeleton(obj):
    doc = inspect.getdoc(obj)
    sections = ["Args:", "Example::", ">>> "] + ([] if obj in WITHOUT_TENSORS else ["Shape:"])
    assert all(section in doc for section in sections), [s for s in sections if s not in doc]
