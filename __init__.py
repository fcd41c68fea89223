"""affdiv: the affine divergence (G. Bird, arXiv 2512.22247) under numerical test.

Subpackages:
    affdiv.theory       symbolic derivations of the effective activation update, with numeric evaluators
    affdiv.verify       checks of every derivation against autograd (jvp after vjp) and a real SGD step
    affdiv.layers       the corrections as production torch layers
    affdiv.experiments  the falsification harness: data, sweeps, results store, statistics, reports
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("affdiv")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
