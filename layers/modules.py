"""The corrected layers as nn.Modules, drop-in for nn.Linear / nn.Conv1d / nn.Conv2d.

Parameters, initialisation (``reset_parameters``), ``extra_repr`` and state_dict keys are those
of the layer each replaces, so a state_dict moves between the two unchanged. The modules are
deliberately not subclasses of nn.Linear / nn.Conv*d: code that special-cases those types
(fusers, attention blocks reading ``.weight`` directly) must not treat them as the plain layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.utils import _ntuple

from affdiv.layers import functional


class _DenseBase(nn.Module):
    """nn.Linear's parameters and initialisation (weight (out, in), bias (out,))."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As nn.Linear: W, b ~ U(−1/√in, 1/√in) (kaiming_uniform with a = √5 for W)."""
        nn.Linear.reset_parameters(self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class AffineLike(_DenseBase):
    """z = (W x + b)/√(‖x‖² + 1) over the last dim of x (any leading shape).

    The affine-like correction: equivalent to the affine map of the L2-normalised augmented
    input [x; 1]/‖[x; 1]‖, so a one-sample gradient step moves z exactly along −g (K_ii = 1).
    Without bias: z = (W x)/√(‖x‖² + 1) (the augmented 1 stays, only b is absent).
    """

    def forward(self, x: Tensor) -> Tensor:
        return functional.affine_like(x, self.weight, self.bias)


class NormLike(_DenseBase):
    """z = W·n(x) + b,  n(x) = x/max(‖x‖, eps) (mode "l2") or √in·x/max(‖x‖, eps) (mode "rms").

    An all-zero input gives n(x) = 0, so z = b. ``eps`` (default 1e-12, as F.normalize) only
    guards that case: for ‖x‖ > eps the layer is exactly W x/‖x‖ + b.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, mode: str = "l2",
        eps: float = functional.DEFAULT_EPS, device=None, dtype=None,
    ):
        if mode not in functional.NORM_MODES:
            raise ValueError(f"NormLike: mode must be one of {functional.NORM_MODES}, got {mode!r}")
        self.mode, self.eps = mode, functional._check_eps("NormLike", eps)
        super().__init__(in_features, out_features, bias, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return functional.norm_like(x, self.weight, self.bias, self.mode, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}, eps={self.eps}"


class _PatchNormConvNd(_ConvNd):
    """nn.ConvNd's parameters, constructor semantics and initialisation; forward divides each
    output position by √(‖patch‖² + 1), the patch being that position's receptive field over the
    input channels of the output channel's group (per group when groups > 1).

    ``recompute=False`` (default) saves the output for backward, as Conv→BatchNorm saves the
    conv output; ``recompute=True`` saves one float per group and position instead and runs the
    forward again in backward (one more convolution). The output keeps the input's memory format
    (contiguous or channels_last, the faster one for CPU convolutions)."""

    _dims: int  # spatial dimensions, set by the concrete classes
    _functional = None  # set by the concrete classes

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, recompute=False):
        if not isinstance(recompute, bool):
            raise TypeError(f"{type(self).__name__}: recompute must be a bool, got {recompute!r}")
        self.recompute = recompute
        ntuple = _ntuple(self._dims)
        super().__init__(
            in_channels, out_channels, ntuple(kernel_size), ntuple(stride),
            padding if isinstance(padding, str) else ntuple(padding), ntuple(dilation), False, ntuple(0),
            groups, bias, padding_mode, device=device, dtype=dtype,
        )

    def forward(self, x: Tensor) -> Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":  # as nn.ConvNd: pad explicitly, then convolve unpadded
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return self._functional(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                                self.recompute)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", recompute=True" if self.recompute else "")


class PatchNormConv1d(_PatchNormConvNd):
    """nn.Conv1d with each output position divided by √(‖patch‖² + 1) (see module doc)."""

    _dims = 1
    _functional = staticmethod(functional.patchnorm_conv1d)


class PatchNormConv2d(_PatchNormConvNd):
    """nn.Conv2d with each output position divided by √(‖patch‖² + 1) (see module doc)."""

    _dims = 2
    _functional = staticmethod(functional.patchnorm_conv2d)
