"""The affine-divergence corrections as production torch layers.

    AffineLike(in, out)          z = (W x + b)/√(‖x‖² + 1)
    NormLike(in, out, mode=…)    z = W x/‖x‖ + b   (or the RMS scaling √in·x/‖x‖)
    PatchNormConv1d/2d(…)        conv output at p divided by √(‖patch_p‖² + 1), per group

Functional forms in ``affdiv.layers.functional``; ``convert`` swaps them into an existing model.
"""

from affdiv.layers import functional
from affdiv.layers.convert import SwapRecord, convert
from affdiv.layers.modules import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d

__all__ = [
    "AffineLike", "NormLike", "PatchNormConv1d", "PatchNormConv2d", "SwapRecord", "convert", "functional",
]
