"""Convolutions (1-D, 2-D; stride, padding, dilation, groups) and PatchNorm.

With P_{p,γ} the receptive-field patch of output position p in group γ (the group's input
channels × the dilated kernel window, zeros where it hangs over the padding), a convolution is
the affine map of its patches,

    conv       z_{o,p} = W_o·P_{p,γ(o)} + b_o
    patchnorm  z_{o,p} = (W_o·P_{p,γ(o)} + b_o) / √(‖P_{p,γ(o)}‖² + 1),

so it is the affine family (theory.affine) whose "samples" are all positions of all samples.
Proven in index form at general size (``conv_index_theorem``: symbolic batch, channels, groups,
kernel, output size, stride, dilation, any padded input; 1-D and 2-D), and corroborated by the
exact real step at concrete geometries:

    Δz_{o,p} = −η Σ_q K^γ_{pq} g_{o,q},   q over every position of every sample,
    conv       K_{pq} = P_p·P_q + 1                                   (diagonal ‖P_p‖² + 1)
    patchnorm  K_{pq} = (P_p·P_q + 1) / √((‖P_p‖²+1)(‖P_q‖²+1))       (diagonal 1)

exactly (both are linear in θ). What PatchNorm leaves off the diagonal is the cosine of the
augmented patches [P;1]: overlapping patches of one sample, and every patch of the other samples.
‖P_p‖² is a box filter over Σ_{c∈γ} x_c²: the conv's geometry with a ones kernel, per group.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import sympy as sp
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from affdiv.theory import affine
from affdiv.theory.cases import channels_first_sites, correlated_rows, require, seed_from
from affdiv.theory.derivation import Case, Derivation, Proof, ProofKind, register
from affdiv.theory.exact import (
    ETA,
    differentiate_entry,
    exact_effective_update,
    is_zero,
    random_rational_matrix,
    symbolic_identity,
)

_CONV = {1: F.conv1d, 2: F.conv2d}


def _tuple(value: int | tuple[int, ...], dims: int, name: str) -> tuple[int, ...]:
    values = (value,) * dims if isinstance(value, int) else tuple(value)
    if len(values) != dims:
        raise ValueError(f"{name} must be an int or {dims} ints, got {value!r}")
    return values


@dataclass(frozen=True)
class Geometry:
    """How a convolution reads its input (torch's conventions, zero padding)."""

    dims: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1

    @classmethod
    def of(cls, dims: int, kernel, stride=1, padding=0, dilation=1, groups: int = 1) -> Geometry:
        if dims not in _CONV:
            raise ValueError(f"dims must be 1 or 2, got {dims!r}")
        if groups < 1:
            raise ValueError(f"groups must be ≥ 1, got {groups}")
        return cls(
            dims,
            _tuple(kernel, dims, "kernel"),
            _tuple(stride, dims, "stride"),
            _tuple(padding, dims, "padding"),
            _tuple(dilation, dims, "dilation"),
            groups,
        )

    def kwargs(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)

    def output_size(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """torch's ⌊(L + 2p − d(k−1) − 1)/s⌋ + 1 per spatial axis."""
        return tuple(
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, k, s, p, d in zip(size, self.kernel, self.stride, self.padding, self.dilation)
        )

    def check_input(self, x: Tensor) -> None:
        if x.dim() != self.dims + 2:
            raise ValueError(f"expected input (B, C, {self.dims} spatial dims), got shape {tuple(x.shape)}")
        if x.shape[1] % self.groups:
            raise ValueError(f"in_channels {x.shape[1]} is not divisible by groups {self.groups}")
        if min(self.output_size(tuple(x.shape[2:]))) < 1:
            raise ValueError(f"input spatial size {tuple(x.shape[2:])} is too small for {self}")


def geometry_of(sizes: Mapping[str, int]) -> Geometry:
    return Geometry.of(
        sizes["dims"], sizes["kernel"], sizes.get("stride", 1), sizes.get("padding", 0),
        sizes.get("dilation", 1), sizes.get("groups", 1),
    )


# ---------------------------------------------------------------------------------------------
# patches, their norms, the kernels


def patches(x: Tensor, geometry: Geometry) -> Tensor:
    """P as (B, L_out, groups, C/groups · ∏kernel), L_out = ∏ output spatial size (unfold)."""
    geometry.check_input(x)
    x2, lift = (x.unsqueeze(2), lambda t, one: (one,) + t) if geometry.dims == 1 else (x, lambda t, one: t)
    cols = F.unfold(
        x2,
        kernel_size=lift(geometry.kernel, 1),
        dilation=lift(geometry.dilation, 1),
        padding=lift(geometry.padding, 0),
        stride=lift(geometry.stride, 1),
    )  # (B, C·∏k, L_out), channel-major: each group's channels are one contiguous block of rows
    batch, _, positions = cols.shape
    return cols.reshape(batch, geometry.groups, -1, positions).permute(0, 3, 1, 2)


def patch_sq_norms_unfold(x: Tensor, geometry: Geometry) -> Tensor:
    """‖P_{p,γ}‖² as (B, groups, *out), by the definition (unfold)."""
    sq = patches(x, geometry).pow(2).sum(-1)  # (B, L_out, groups)
    return sq.permute(0, 2, 1).reshape((x.shape[0], geometry.groups) + geometry.output_size(tuple(x.shape[2:])))


def patch_sq_norms_box(x: Tensor, geometry: Geometry) -> Tensor:
    """‖P_{p,γ}‖² as (B, groups, *out), as a box filter: conv(x², ones) with the conv's geometry."""
    geometry.check_input(x)
    ones = x.new_ones((geometry.groups, x.shape[1] // geometry.groups) + geometry.kernel)
    return _CONV[geometry.dims](x * x, ones, **geometry.kwargs())


def _per_channel(per_group: Tensor, out_channels: int) -> Tensor:
    """(B, groups, *out) -> (B, out_channels, *out): output channel o takes its group's value."""
    return per_group.repeat_interleave(out_channels // per_group.shape[1], dim=1)


def conv_kernel(x: Tensor, geometry: Geometry, normalised: bool) -> Tensor:
    """K^γ_{pq} as (groups, N, N) over the N = B·L_out positions of the batch (sample-major)."""
    p = patches(x, geometry).flatten(0, 1)  # (N, groups, k)
    kernel = torch.einsum("pgk,qgk->gpq", p, p) + 1
    if normalised:
        r = torch.rsqrt(p.pow(2).sum(-1) + 1).T  # (groups, N)
        kernel = kernel * r[:, :, None] * r[:, None, :]
    return kernel


def _as_rows(t: Tensor, groups: int) -> Tensor:
    """(B, C_out, *out) -> (N, groups, C_out/groups), N sample-major then position."""
    return t.flatten(2).permute(0, 2, 1).reshape(-1, groups, t.shape[1] // groups)


def _from_rows(rows: Tensor, like: Tensor) -> Tensor:
    batch, channels = like.shape[:2]
    return rows.reshape(batch, -1, channels).permute(0, 2, 1).reshape(like.shape)


def predict_conv(x: Tensor, geometry: Geometry, grad_output: Tensor, lr: float, normalised: bool) -> Tensor:
    """Δz = −η Σ_q K_{pq} g_q, shaped like the output."""
    kernel = conv_kernel(x, geometry, normalised)
    rows = torch.einsum("gpq,qgo->pgo", kernel, _as_rows(grad_output, geometry.groups))
    return _from_rows(-lr * rows, grad_output)


def conv_site_diagonal(x: Tensor, geometry: Geometry, out_channels: int, normalised: bool) -> Tensor:
    """K_pp per output entry (B, C_out, *out): ‖P_p‖² + 1 for conv, 1 for PatchNorm."""
    sq = patch_sq_norms_unfold(x, geometry)
    return _per_channel(torch.ones_like(sq) if normalised else sq + 1, out_channels)


@dataclass(frozen=True)
class Coupling:
    """Per site (B, *out): ‖K_pp g_p‖ and the shares of the same sample's other positions and of
    the other samples, ‖Σ_{q≠p, same sample} K_pq g_q‖/‖K_pp g_p‖ and ‖Σ_{other samples} …‖/‖K_pp g_p‖."""

    own: Tensor
    same_sample_share: Tensor
    other_samples_share: Tensor


def coupling(x: Tensor, geometry: Geometry, grad_output: Tensor, normalised: bool) -> Coupling:
    """Split the closed-form update of every site into own / same-sample / other-sample parts.
    The shares divide by ‖K_pp g_p‖: NaN or inf at a site whose own gradient g_p is 0 (not guarded)."""
    kernel = conv_kernel(x, geometry, normalised)
    n = kernel.shape[-1]
    sample = torch.arange(x.shape[0]).repeat_interleave(n // x.shape[0])
    same = sample[:, None] == sample[None, :]
    eye = torch.eye(n, dtype=torch.bool)
    g = _as_rows(grad_output, geometry.groups)

    def part(mask: Tensor) -> Tensor:
        rows = torch.einsum("gpq,qgo->pgo", kernel * mask, g).flatten(1)
        return rows.norm(dim=-1).reshape((x.shape[0],) + grad_output.shape[2:])

    own = part(eye)
    return Coupling(own, part(same & ~eye) / own, part(~same) / own)


# ---------------------------------------------------------------------------------------------
# reference layers


class ReferencePatchNormConv(nn.Module):
    """Reference PatchNorm: a conv whose output at p is divided by √(‖P_p‖²+1), ‖P_p‖² computed as
    the box filter (so the check against the unfold closed form also tests box = unfold)."""

    def __init__(self, conv: nn.Module, geometry: Geometry):
        super().__init__()
        self.conv, self.geometry = conv, geometry

    def forward(self, x: Tensor) -> Tensor:
        sq = _per_channel(patch_sq_norms_box(x, self.geometry), self.conv.out_channels)
        return self.conv(x) / torch.sqrt(sq + 1)


def make_conv(geometry: Geometry, in_channels: int, out_channels: int) -> nn.Module:
    cls = {1: nn.Conv1d, 2: nn.Conv2d}[geometry.dims]
    return cls(in_channels, out_channels, geometry.kernel, dtype=torch.float64, **geometry.kwargs())


# ---------------------------------------------------------------------------------------------
# proofs


@dataclass(frozen=True)
class IndexForm:
    """A convolution with ``dims`` spatial axes in index form, every size and step a symbol:

        z[n, o, p] = α(n, p) (Σ_{c<C_g} Σ_k W[o, c, k] x[n, γ(o)·C_g + c, s·p + d·k] + b[o])

    n < B the sample, o < O the output channel, p and k multi-indices (p_a < L_a, k_a < K_a), s_a
    and d_a the stride and dilation of axis a, x the padded input (any θ-independent array: zero
    padding is a linear map of the input, so it is covered), γ(o) the group of output channel o
    (any function: the group restriction), C_g the input channels per group, α(n, p) any
    θ-independent factor: 1 for the conv, 1/√(‖P_{n,p}‖² + 1) for PatchNorm. The patch is
    P_{n,p,γ}[c, k] = x[n, γ·C_g + c, s·p + d·k], so P_{n,p}·P_{n',q} = Σ_{c,k} of their products.
    """

    dims: int

    def _symbols(self, names: str, **assumptions) -> tuple[sp.Symbol, ...]:
        return sp.symbols(" ".join(f"{names}{a}" for a in range(self.dims)), seq=True, **assumptions)

    @property
    def sizes(self) -> dict[str, sp.Symbol]:
        positive = dict(integer=True, positive=True)
        return {"B": sp.Symbol("B", **positive), "O": sp.Symbol("O", **positive),
                "C_g": sp.Symbol("C_g", **positive)}

    @property
    def kernel(self) -> tuple[sp.Symbol, ...]:
        return self._symbols("K", integer=True, positive=True)

    @property
    def positions(self) -> tuple[sp.Symbol, ...]:
        return self._symbols("L", integer=True, positive=True)

    def index(self, name: str) -> tuple[sp.Symbol, ...]:
        """A multi-index of nonnegative integer symbols name0, name1, …"""
        return self._symbols(name, integer=True, nonnegative=True)

    @property
    def arrays(self) -> dict[str, sp.IndexedBase]:
        return {name: sp.IndexedBase(name) for name in ("W", "b", "x", "g")}

    def tap(self, n, channel, p, k) -> sp.Expr:
        """x[n, channel, s·p + d·k]."""
        stride = self._symbols("s", integer=True, positive=True)
        dilation = self._symbols("d", integer=True, positive=True)
        return self.arrays["x"][(n, channel) + tuple(s * pa + d * ka for s, d, pa, ka in zip(stride, dilation, p, k))]

    def channel(self, o, c) -> sp.Expr:
        """Input channel c of output channel o's group: γ(o)·C_g + c."""
        return sp.Function("gamma")(o) * self.sizes["C_g"] + c

    def scale(self, n, p) -> sp.Expr:
        return sp.Function("alpha")(n, *p)

    def window(self, k) -> tuple:
        """The sum over c < C_g and the kernel window k, as sympy limits."""
        return ((sp.Symbol("c", integer=True, nonnegative=True), 0, self.sizes["C_g"] - 1),) + tuple(
            (ka, 0, size - 1) for ka, size in zip(k, self.kernel)
        )

    def output(self, weight, bias, n, o, p) -> sp.Expr:
        """z[n, o, p] with weight(o, c, *k) and bias(o) giving the parameters."""
        k = self.index("k")
        c = self.window(k)[0][0]
        return self.scale(n, p) * (
            sp.Sum(weight(o, c, *k) * self.tap(n, self.channel(o, c), p, k), *self.window(k)) + bias(o)
        )

    def patch_dot(self, o, n, p, m, q) -> sp.Expr:
        """P_{n,p,γ(o)} · P_{m,q,γ(o)}: the patches of output channel o's group."""
        k = self.index("k")
        c = self.window(k)[0][0]
        return sp.Sum(self.tap(n, self.channel(o, c), p, k) * self.tap(m, self.channel(o, c), q, k), *self.window(k))

    def over_sites(self, m, q) -> tuple:
        """The sum over every position q of every sample m, as sympy limits."""
        return ((m, 0, self.sizes["B"] - 1),) + tuple((qa, 0, size - 1) for qa, size in zip(q, self.positions))

    def closed_form(self, n, o, p) -> sp.Expr:
        """Δz[n, o, p] = −η α(n, p) Σ_{m,q} α(m, q) (P_{n,p}·P_{m,q} + 1) g[m, o, q]."""
        m, q = sp.Symbol("m", integer=True, nonnegative=True), self.index("q")
        kernel = self.scale(n, p) * self.scale(m, q) * (self.patch_dot(o, n, p, m, q) + 1)
        return -ETA * sp.Sum(kernel * self.arrays["g"][(m, o) + q], *self.over_sites(m, q))


def conv_index_theorem(dims: int, closed_form=IndexForm.closed_form) -> Proof:
    """One SGD step of the index-form conv (``IndexForm``) at general sizes: the derivative of
    L = Σ g·z in W[a, e, f] is a product of Kronecker deltas, summing them gives ΔW and Δb, and
    z(θ + Δθ) − z(θ) equals ``closed_form`` (a parameter so that a planted-wrong one can be shown
    to fail)."""
    form = IndexForm(dims)
    W, b, g = (form.arrays[name] for name in "Wbg")
    n, o2, m = sp.symbols("n o2 m", integer=True, nonnegative=True)
    o, a, e = sp.symbols("o a e", integer=True, nonnegative=True)
    p, q, f = form.index("p"), form.index("q"), form.index("f")
    sizes = form.sizes
    loss = sp.Sum(
        g[(m, o2) + q] * form.output(lambda *i: W[i], lambda i: b[i], m, o2, q),
        (o2, 0, sizes["O"] - 1), *form.over_sites(m, q),
    )
    grad_w = differentiate_entry(loss, W[(a, e) + f], (sizes["O"], sizes["C_g"]) + form.kernel)
    grad_b = differentiate_entry(loss, b[a], (sizes["O"],))

    def stepped_weight(o_, c_, *k_):
        return W[(o_, c_) + k_] - ETA * grad_w.subs(dict(zip((a, e) + f, (o_, c_) + k_)), simultaneous=True)

    def stepped_bias(o_):
        return b[o_] - ETA * grad_b.subs(a, o_)

    effective = form.output(stepped_weight, stepped_bias, n, o, p) - form.output(
        lambda *i: W[i], lambda i: b[i], n, o, p
    )
    axes = "1-D" if dims == 1 else f"{dims}-D"
    return symbolic_identity(
        f"{axes} conv in index form, z[n,o,p] = α(n,p) (Σ_{{c∈γ(o),k}} W[o,c,k] x_pad[n,c,s·p+d·k] + b[o]), "
        "at symbolic B, O, C_g, kernel, output size, stride s, dilation d, group map γ, any θ-independent x_pad "
        "and α: ∂L/∂W is a product of Kronecker deltas; summed, z(θ+Δθ) − z(θ) = −η α(n,p) Σ_{m,q} α(m,q) "
        "(P_{n,p}·P_{m,q} + 1) g[m,o,q] exactly (conv: α = 1; PatchNorm: α = 1/√(‖P‖²+1))",
        effective - closed_form(form, n, o, p),
    )


def _tap(x: list, sample: int, channel: int, position: tuple, offset: tuple, geometry: Geometry):
    """x[sample][channel][position·s − pad + offset·d], 0 in the padding (nested lists, sympy)."""
    value = x[sample][channel]
    for p, k, s, pad, d in zip(position, offset, geometry.stride, geometry.padding, geometry.dilation):
        i = p * s - pad + k * d
        if not 0 <= i < len(value):
            return sp.Integer(0)
        value = value[i]
    return value


def _index_grid(extent: tuple[int, ...]) -> list[tuple[int, ...]]:
    grid = [()]
    for n in extent:
        grid = [g + (i,) for g in grid for i in range(n)]
    return grid


def _exact_patch_rows(x: list, geometry: Geometry, in_channels: int, out_size: tuple) -> list[list[list]]:
    """rows[γ][(sample, position)] = the patch, gathered by the index definition."""
    per_group = in_channels // geometry.groups
    positions = [(b, p) for b in range(len(x)) for p in _index_grid(out_size)]
    return [
        [
            [_tap(x, b, g * per_group + c, p, k, geometry)
             for c in range(per_group) for k in _index_grid(geometry.kernel)]
            for b, p in positions
        ]
        for g in range(geometry.groups)
    ]


def _nested(flat: list, shape: tuple[int, ...]) -> list:
    """A flat list as nested lists of the given shape (row-major)."""
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nested(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def exact_conv_proof(sizes: Mapping[str, int], normalised: bool, seed: int = 0) -> Proof:
    """finite step = J Δθ = −η Σ_q K_pq g_q exactly, for a conv written as its index definition
    z_{b,o,p} = b_o + Σ_{c∈γ(o), k} W_{o,c,k} x_{b,c,p·s−pad+k·d}, at one small geometry."""
    geometry = geometry_of(sizes)
    rng = random.Random(seed)
    batch, cin, cout = sizes["batch"], sizes["in_channels"], sizes["out_channels"]
    spatial = (sizes["size"],) * geometry.dims
    x = _nested(list(random_rational_matrix(batch * cin * int(sp.prod(spatial)), 1, rng)), (batch, cin) + spatial)
    out_size = geometry.output_size(spatial)
    rows = _exact_patch_rows(x, geometry, cin, out_size)
    norms = [[sp.sqrt(sum(v**2 for v in row) + 1) if normalised else sp.Integer(1) for row in group] for group in rows]
    per_out = cout // geometry.groups
    taps = cin // geometry.groups * int(sp.prod(geometry.kernel))

    def forward(params):
        W, b = params["W"], params["b"]
        return sp.Matrix(
            len(rows[0]), cout,
            lambda n, o: (sum(W[o, k] * rows[o // per_out][n][k] for k in range(taps)) + b[o]) / norms[o // per_out][n],
        )

    params = {"W": random_rational_matrix(cout, taps, rng), "b": random_rational_matrix(cout, 1, rng)}
    grad = random_rational_matrix(len(rows[0]), cout, rng)
    exact = exact_effective_update(forward, params, grad)
    kernels = [
        sp.Matrix(len(r), len(r), lambda p, q, r=r, nm=nm: (sum(a * c for a, c in zip(r[p], r[q])) + 1)
                  / (nm[p] * nm[q]))
        for r, nm in zip(rows, norms)
    ]
    predicted = sp.Matrix.hstack(
        *[-ETA * kernels[o // per_out] * grad[:, o] for o in range(cout)]
    )
    holds = is_zero(exact.finite - predicted) and is_zero(exact.linear - predicted)
    label = ", ".join(f"{k}={v}" for k, v in sizes.items())
    return Proof(
        claim=f"{'PatchNorm' if normalised else 'conv'}: the real step and J Δθ both equal "
        "−η Σ_q K_pq g_q as an identity in η (no O(η²) term)",
        kind=ProofKind.EXACT_CONCRETE,
        holds=holds,
        detail=f"exact rational{'/algebraic' if normalised else ''} arithmetic at {label}",
    )


@cache
def patchnorm_diagonal_proof() -> Proof:
    """K_pp = 1: PatchNorm is the affine-like member with the patch as its input."""
    member = affine.member("affine_like")
    got = member.diagonal_factor
    return Proof(
        claim="PatchNorm's diagonal K_pp = (‖P_p‖²+1)/(√(‖P_p‖²+1))² = 1 at every position",
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=sp.simplify(got - 1) == 0,
        detail=f"the affine-like kernel at d = s_i = s_j = ‖P‖² simplifies to {sp.sstr(got)}",
    )


_EXACT_SIZES = (
    {"dims": 1, "batch": 2, "in_channels": 2, "out_channels": 2, "size": 4, "kernel": 2, "stride": 2, "padding": 1,
     "dilation": 1, "groups": 2},
    {"dims": 2, "batch": 1, "in_channels": 1, "out_channels": 2, "size": 3, "kernel": 2, "stride": 1, "padding": 0,
     "dilation": 1, "groups": 1},
    {"dims": 1, "batch": 1, "in_channels": 1, "out_channels": 1, "size": 5, "kernel": 2, "stride": 1, "padding": 1,
     "dilation": 2, "groups": 1},
)


@cache
def conv_theorems() -> tuple[Proof, ...]:
    """The index-form theorem for 1-D and 2-D convolutions (the dims the layers support)."""
    return tuple(conv_index_theorem(dims) for dims in (1, 2))


@cache
def _proofs(normalised: bool) -> tuple[Proof, ...]:
    """The index-form theorem at general size (``conv_index_theorem``, 1-D and 2-D) is the proof for
    both layers: the conv is α = 1, PatchNorm α = 1/√(‖P‖²+1), a θ-independent factor. The exact
    real step of the index-defined layer at concrete geometries corroborates it (it also shows
    the step has no O(η²) term in float-free arithmetic)."""
    # PatchNorm's radicals make sympy's simplification ~3-5 s per size: one geometry (1-D, stride,
    # padding, two groups) for it, all three for the plain conv.
    exact = [exact_conv_proof(s, normalised) for s in (_EXACT_SIZES[:1] if normalised else _EXACT_SIZES)]
    steps = [
        *conv_theorems(),
        Proof(
            claim=exact[0].claim + ", for the conv written by its index definition (stride, padding, "
            "dilation, groups) at concrete geometries",
            kind=ProofKind.EXACT_CONCRETE,
            holds=all(p.holds for p in exact),
            detail="; ".join(p.detail for p in exact),
            corroborates=True,
        ),
    ]
    if normalised:
        steps.insert(2, patchnorm_diagonal_proof())
    return tuple(steps)


# ---------------------------------------------------------------------------------------------
# registration

SIZES = (
    {"dims": 1, "batch": 3, "in_channels": 2, "out_channels": 3, "size": 9, "kernel": 3, "stride": 1, "padding": 1,
     "dilation": 1, "groups": 1},
    {"dims": 1, "batch": 2, "in_channels": 4, "out_channels": 4, "size": 11, "kernel": 3, "stride": 2, "padding": 2,
     "dilation": 2, "groups": 2},
    {"dims": 2, "batch": 2, "in_channels": 2, "out_channels": 3, "size": 6, "kernel": 3, "stride": 1, "padding": 1,
     "dilation": 1, "groups": 1},
    {"dims": 2, "batch": 2, "in_channels": 4, "out_channels": 2, "size": 7, "kernel": 2, "stride": 2, "padding": 1,
     "dilation": 2, "groups": 2},
    {"dims": 2, "batch": 1, "in_channels": 1, "out_channels": 1, "size": 3, "kernel": 3, "stride": 1, "padding": 0,
     "dilation": 1, "groups": 1},
)


def build_case(sizes: Mapping[str, int], generator: torch.Generator, normalised: bool) -> Case:
    require(sizes, "dims", "batch", "in_channels", "out_channels", "size", "kernel")
    geometry = geometry_of(sizes)
    torch.manual_seed(seed_from(generator))
    conv = make_conv(geometry, sizes["in_channels"], sizes["out_channels"])
    module = ReferencePatchNormConv(conv, geometry) if normalised else conv
    x = correlated_rows((sizes["batch"], sizes["in_channels"]) + (sizes["size"],) * geometry.dims, generator)
    return Case(module, (x,))


def _conv_of(case: Case) -> nn.Module:
    return case.module.conv if isinstance(case.module, ReferencePatchNormConv) else case.module


def _geometry_of_case(case: Case) -> Geometry:
    conv = _conv_of(case)
    dims = len(conv.kernel_size)
    return Geometry.of(dims, conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups)


def make_derivation(normalised: bool) -> Derivation:
    name = "patchnorm" if normalised else "conv"
    layer = (
        r"z_{o,p} = \frac{W_o \cdot P_p + b_o}{\sqrt{\|P_p\|^2 + 1}}" if normalised
        else r"z_{o,p} = W_o \cdot P_p + b_o"
    )
    kernel = (
        r"\frac{P_p \cdot P_q + 1}{\sqrt{(\|P_p\|^2+1)(\|P_q\|^2+1)}}" if normalised else r"P_p \cdot P_q + 1"
    )
    diagonal = "1" if normalised else r"\|P_p\|^2 + 1"

    return Derivation(
        name=name,
        layer=layer,
        statement=rf"{layer}:\quad \Delta z_{{o,p}} = -\eta \sum_q K_{{pq}} g_{{o,q}},\quad K_{{pq}} = {kernel},"
        rf"\quad K_{{pp}} = {diagonal}\quad (q \text{{ over all positions of all samples, per group}})",
        build=lambda sizes, generator: build_case(sizes, generator, normalised),
        predict=lambda case, g, lr: predict_conv(case.inputs[0], _geometry_of_case(case), g, lr, normalised),
        proofs=lambda: _proofs(normalised),
        sizes=SIZES,
        linear_in_params=True,
        tags=("conv",),
        sites=channels_first_sites,
        site_diagonal=lambda case: conv_site_diagonal(
            case.inputs[0], _geometry_of_case(case), _conv_of(case).out_channels, normalised
        ),
    )


DERIVATIONS = tuple(register(make_derivation(normalised)) for normalised in (False, True))
