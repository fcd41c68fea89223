"""Pre-norm transformer blocks written out in matmuls and a softmax, and the small vision
transformer behind the harness's ``vit`` methods.

Everything here is plain tensor algebra (no fused attention kernel): ``torch.func`` can vmap it,
and :func:`~affdiv.experiments.runs.batched.batched_vit` writes the same forward for K stacked
models, on which the stacked engine trains these models as it trains the MLPs and CNNs.

Attention on the tokens X (T, d) of one sequence, H heads of size d_h = d/H, head h:

    Q_h = P_q(X)_h,  K_h = P_k(X)_h,  V_h = P_v(X)_h       (columns h·d_h … (h+1)·d_h − 1)
    QK-norm:  Q_h ← g_q ⊙ Q_h / rms(Q_h),  K_h ← g_k ⊙ K_h / rms(K_h)
              (RMSNorm over each token's d_h entries, one learned gain g per side, shared by heads)
    Attn(X) = P_o([softmax(Q_1 K_1ᵀ/√d_h) V_1, …, softmax(Q_H K_Hᵀ/√d_h) V_H])   (softmax row-wise)

with P_q, P_k, P_v, P_o maps d → d: nn.Linear, or AffineLike (P(x) = (W x + b)/√(‖x‖² + 1), each
token its own x). A block, pre-norm:

    X ← X + Attn(N_1(X)),   X ← X + P_2(act(P_1(N_2(X))))       (P_1: d → 2d, P_2: 2d → d)

with N_1, N_2 LayerNorm, or the identity (no normalisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

Projection = Callable[[int, int], nn.Module]

#: The vision transformer's heads (fixed: the head size is width / HEADS) and its patch grid
#: (GRID x GRID patches, each image cut into that many, whatever its size).
HEADS = 4
GRID = 4


def projection(affine_like: bool) -> Projection:
    """The class of every q, k, v, o and MLP projection: AffineLike or nn.Linear."""
    if affine_like:
        from affdiv.layers import AffineLike

        return AffineLike
    return nn.Linear


class Patches(nn.Module):
    """(B, C, H, W) -> (B, (H/p)·(W/q), C·p·q): the image cut into p x q patches, row-major, each
    patch's pixels in Conv2d's weight order (channel, row, column)."""

    def __init__(self, patch: tuple[int, int]):
        super().__init__()
        self.patch = patch

    def forward(self, x: Tensor) -> Tensor:
        (p, q), (batch, channels, height, width) = self.patch, x.shape
        x = x.reshape(batch, channels, height // p, p, width // q, q).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(batch, (height // p) * (width // q), channels * p * q)

    def extra_repr(self) -> str:
        return f"patch={self.patch}"


class PositionEmbedding(nn.Module):
    """x + P, P a learned (T, d) table, initialised N(0, 0.02²)."""

    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(tokens, dim) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight


class Attention(nn.Module):
    """Multi-head self-attention written out (module docstring), with separate q, k, v, o
    projections so that each is measured; QK-norm: RMSNorm on each head's queries and keys."""

    def __init__(self, dim: int, heads: int, affine_like: bool, qk_norm: bool):
        super().__init__()
        if dim % heads:
            raise ValueError(f"the width must be a multiple of the {heads} attention heads, got {dim}")
        proj = projection(affine_like)
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (proj(dim, dim) for _ in range(4))
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        # a module, so that the memory estimates (runs/ensembles.py) see the H·T² attention weights
        self.softmax = nn.Softmax(dim=-1)

    def _split(self, t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        y = self.softmax(scores) @ v
        return self.o(y.transpose(1, 2).reshape(x.shape))


class TransformerBlock(nn.Module):
    """Pre-norm: x + Attn(N_1(x)), then x + MLP(N_2(x)); N LayerNorm (``norm``) or the identity,
    MLP d -> 2d -> d with ``activation`` between."""

    def __init__(self, dim: int, heads: int, affine_like: bool, qk_norm: bool, norm: bool = True,
                 activation: Callable[[], nn.Module] = nn.GELU):
        super().__init__()
        proj = projection(affine_like)
        self.norm1, self.norm2 = (nn.LayerNorm(dim) if norm else nn.Identity() for _ in range(2))
        self.attn = Attention(dim, heads, affine_like, qk_norm)
        self.mlp = nn.Sequential(proj(dim, 2 * dim), activation(), proj(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """The harness's ViT on images (C, H, W), H and W multiples of ``GRID``:

        patches (a GRID x GRID grid, H/GRID x W/GRID pixels each: GRID² tokens of C·H·W/GRID² features)
        -> nn.Linear embedding to d -> + learned position embedding
        -> ``depth`` pre-norm blocks (module docstring; ``HEADS`` heads)
        -> N (LayerNorm, or the identity without normalisation) -> mean over tokens -> nn.Linear read-out

    The embedding and read-out are nn.Linear for every variant (as the MLPs' read-out is): the
    variants differ in the blocks only.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, depth: int, dim: int,
                 activation: Callable[[], nn.Module], affine_like: bool, qk_norm: bool, norm: bool):
        super().__init__()
        if len(input_shape) != 3 or input_shape[1] % GRID or input_shape[2] % GRID:
            raise ValueError(f"the vision transformer needs image inputs (C, H, W) with H and W multiples of "
                             f"{GRID}; got input shape {tuple(input_shape)}")
        channels, height, width = input_shape
        patch = (height // GRID, width // GRID)
        self.patches = Patches(patch)
        self.embed = nn.Linear(channels * patch[0] * patch[1], dim)
        self.position = PositionEmbedding(GRID * GRID, dim)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, HEADS, affine_like, qk_norm, norm, activation)
                                      for _ in range(depth)))
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.position(self.embed(self.patches(x))))
        return self.head(self.norm(h).mean(dim=1))
