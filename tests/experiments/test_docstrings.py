"""The examples in the experiments' public docstrings run and give what they show."""

import doctest

import pytest

import affdiv.experiments.data.dataset
import affdiv.experiments.runs.config


@pytest.mark.parametrize("module", [affdiv.experiments.data.dataset, affdiv.experiments.runs.config],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
