"""The corrected layers as nn.Modules, drop-in for nn.Linear / nn.Conv1d / nn.Conv2d.

Parameters, initialisation (``reset_parameters``), ``extra_repr`` and state_dict keys are those
of the layer each replaces, so a state_dict moves between the two unchanged. The modules are
deliberately not subclasses of nn.Linear / nn.Conv*d: code that special-cases those types
(fusers, attention blocks reading ``.weight`` directly) must not treat them as the plain layer.
"""

from __future__ import annotations

from string import Template

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
    r"""The affine-like correction over the last dimension: :math:`z = (W x + b)/\sqrt{\|x\|^2 + 1}`.

    A drop-in for ``nn.Linear`` (the same constructor, parameters, initialisation and
    state_dict keys). It is the affine map of the L2-normalised augmented input
    [x; 1]/‖[x; 1]‖, so a one-sample gradient step moves z exactly along −g (K_ii = 1).
    Without bias: z = (W x)/√(‖x‖² + 1) (the augmented 1 stays, only b is absent).

    Args:
        in_features: size m of each input sample.
        out_features: size n of each output sample.
        bias: learn the additive bias b (inside the scale). Default: ``True``.
        device: the parameters' device. Default: ``None`` (torch's default).
        dtype: the parameters' dtype. Default: ``None`` (torch's default).

    Shape:
        - Input: :math:`(*, m)`, any leading dimensions.
        - Output: :math:`(*, n)`.

    Attributes:
        weight: :math:`(n, m)`, initialised as ``nn.Linear``'s, :math:`U(-1/\sqrt{m}, 1/\sqrt{m})`.
        bias: :math:`(n,)`, the same, or ``None``.

    Example::

        >>> import torch
        >>> from affdiv.layers import AffineLike
        >>> layer = AffineLike(20, 30)
        >>> layer(torch.randn(128, 20)).shape
        torch.Size([128, 30])
        >>> torch.equal(layer(torch.zeros(20)), layer.bias)  # ‖x‖ = 0: z = b
        True
    """

    def forward(self, x: Tensor) -> Tensor:
        return functional.affine_like(x, self.weight, self.bias)


class NormLike(_DenseBase):
    r"""The norm-like correction over the last dimension: :math:`z = W\,k\,x/\max(\|x\|, \epsilon) + b`,
    k = 1 (``mode="l2"``, the layer kind ``norm_l2``) or k = √m (``mode="rms"``, ``norm_rms``).

    A drop-in for ``nn.Linear`` (the same parameters, initialisation and state_dict keys). An
    all-zero input gives z = b; ``eps`` only guards that case: for ‖x‖ > eps the layer is
    exactly W k x/‖x‖ + b, so z does not change when x is scaled.

    Args:
        in_features: size m of each input sample.
        out_features: size n of each output sample.
        bias: learn the additive bias b (outside the scale). Default: ``True``.
        mode: ``"l2"`` (k = 1) or ``"rms"`` (k = √m). Default: ``"l2"``.
        eps: the smallest norm divided by, a finite number > 0. Default: ``1e-12`` (as
            ``F.normalize``).
        device: the parameters' device. Default: ``None`` (torch's default).
        dtype: the parameters' dtype. Default: ``None`` (torch's default).

    Shape:
        - Input: :math:`(*, m)`, any leading dimensions.
        - Output: :math:`(*, n)`.

    Attributes:
        weight: :math:`(n, m)`, initialised as ``nn.Linear``'s.
        bias: :math:`(n,)`, the same, or ``None``.

    Example::

        >>> import torch
        >>> from affdiv.layers import NormLike
        >>> layer = NormLike(16, 4, mode="rms")
        >>> x = torch.randn(8, 16)
        >>> layer(x).shape
        torch.Size([8, 4])
        >>> torch.allclose(layer(1000 * x), layer(x), rtol=1e-5, atol=1e-6)  # invariant to the scale of x
        True
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

    ``recompute=False`` (default) keeps the output for backward, as Conv→BatchNorm saves the
    conv output (an in-place op on it afterwards, as ReLU(inplace=True), makes backward
    recompute it instead); ``recompute=True`` saves one float per group and position instead
    and runs the forward again in backward (one more convolution). The output keeps the
    input's memory format (contiguous or channels_last, the faster one for CPU convolutions)."""

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


# What the docstrings of PatchNormConv1d and PatchNormConv2d share ($dims: the spatial dimensions): the
# formula, the drop-in promise and the Args; each class adds its Shape and Example.
_PATCHNORM_CONV_DOC = Template(r"""``nn.Conv${dims}d`` with each output position divided by √(‖patch‖² + 1):
    :math:`z_{o,p} = (W_o \cdot P_p + b_o)/\sqrt{\|P_p\|^2 + 1}`, P_p the receptive field of
    position p over the input channels of o's group.

    A drop-in for ``nn.Conv${dims}d``: every argument, every padding mode (``"same"``, ``"valid"``,
    ints; zeros, reflect, replicate, circular) and groups, the same parameters, initialisation
    and state_dict keys.

    Args:
        in_channels: C_in, the input channels.
        out_channels: C_out, the output channels.
        kernel_size: an int or $dims ints.
        stride: an int or $dims ints. Default: 1.
        padding: an int, $dims ints, ``"same"`` (stride 1 only) or ``"valid"``. Default: 0.
        dilation: an int or $dims ints. Default: 1.
        groups: input and output channels split into this many groups, each position
            normalised per group. Default: 1.
        bias: learn the additive bias (inside the scale). Default: ``True``.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"``. Default:
            ``"zeros"``.
        device: the parameters' device. Default: ``None`` (torch's default).
        dtype: the parameters' dtype. Default: ``None`` (torch's default).
        recompute: save one float per group and position for backward instead of keeping the
            output, and run the forward again in backward (one more convolution). Default:
            ``False``.
""")


class PatchNormConv1d(_PatchNormConvNd):
    __doc__ = _PATCHNORM_CONV_DOC.substitute(dims=1) + r"""
    Shape:
        - Input: :math:`(N, C_{in}, L_{in})` or :math:`(C_{in}, L_{in})`.
        - Output: :math:`(N, C_{out}, L_{out})` or :math:`(C_{out}, L_{out})`, :math:`L_{out}`
          as ``nn.Conv1d``'s.

    Example::

        >>> import torch
        >>> from affdiv.layers import PatchNormConv1d
        >>> layer = PatchNormConv1d(4, 8, 3, padding="same", groups=2)
        >>> layer(torch.randn(5, 4, 32)).shape
        torch.Size([5, 8, 32])
    """

    _dims = 1
    _functional = staticmethod(functional.patchnorm_conv1d)


class PatchNormConv2d(_PatchNormConvNd):
    __doc__ = _PATCHNORM_CONV_DOC.substitute(dims=2) + r"""
    Shape:
        - Input: :math:`(N, C_{in}, H_{in}, W_{in})` or :math:`(C_{in}, H_{in}, W_{in})`.
        - Output: :math:`(N, C_{out}, H_{out}, W_{out})` or :math:`(C_{out}, H_{out}, W_{out})`,
          :math:`H_{out}, W_{out}` as ``nn.Conv2d``'s, in the input's memory format (contiguous or
          channels_last).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from affdiv.layers import PatchNormConv2d
        >>> model = nn.Sequential(PatchNormConv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True))
        >>> z = model(torch.randn(2, 3, 16, 16, requires_grad=True))
        >>> z.shape
        torch.Size([2, 8, 16, 16])
        >>> z.sum().backward()  # the in-place ReLU changed the output it keeps: recomputed
    """

    _dims = 2
    _functional = staticmethod(functional.patchnorm_conv2d)
