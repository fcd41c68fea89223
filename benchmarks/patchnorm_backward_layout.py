"""PatchNormConv2d on NCHW input: its backward convolution in channels_last against in NCHW.

The layer runs the backward convolution of a float32 NCHW input in channels_last, with the
layout changes folded into its own passes (``affdiv.layers._autograd._channels_last_backward``).
This times, forward+backward, interleaved and paired per round as ``affdiv bench layers`` does:
the layer as shipped, the same layer with that switch off (NCHW throughout), nn.Conv2d, and
(unless ``--no-compile``) torch.compile of the naive composite; it prints the median paired
ratios with their distribution-free 95% intervals. With ``--dtype float64`` the switch is forced
on (the layer itself keeps float64 in NCHW). docs/FINDINGS.md quotes its runs.

    python benchmarks/patchnorm_backward_layout.py [--rounds 15] [--batch 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from affdiv.layers import _autograd, _fused
from affdiv.layers import benchmark as bench


class _Switched(nn.Module):
    """The layer under the given channels_last-backward policy (set at each call: the variants
    share the process)."""

    def __init__(self, layer: nn.Module, policy):
        super().__init__()
        self.layer, self.policy = layer, policy

    def forward(self, x):
        _autograd._channels_last_backward = self.policy
        return self.layer(x)


_POLICY = _autograd._channels_last_backward


def _forced(x: torch.Tensor, layout: torch.memory_format) -> bool:
    """The policy without its float32 condition (to measure float64, which it leaves NCHW)."""
    return layout == torch.contiguous_format and x.dim() == 4 and _fused.usable(x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args(argv)
    if args.rounds < 6:
        parser.error(f"--rounds: a 95% interval of the median needs at least 6 rounds, got {args.rounds}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    variants = bench.conv_variants(args.channels, args.channels, 3, None if args.no_compile else "inductor")
    layer = next(v.module for v in variants if v.name == "PatchNormConv2d")
    variants = [v for v in variants if v.name in ("nn.Conv2d", "compiled naive PatchNormConv2d")] + [
        bench.Variant("NCHW backward", _Switched(layer, lambda x, layout: False), "layer"),
        bench.Variant("channels_last backward", _Switched(layer, _POLICY if dtype == torch.float32 else _forced),
                      "layer"),
    ]
    for v in variants:
        v.module.to(dtype)
    x = torch.randn(args.batch, args.channels, args.size, args.size, dtype=dtype)
    print(f"timing {len(variants)} variants x {args.rounds} rounds at {tuple(x.shape)} {args.dtype}, "
          f"{args.threads} threads ...", flush=True)
    try:
        times = bench.time_case(variants, x, args.warmup, args.rounds)
    finally:
        _autograd._channels_last_backward = _POLICY
    for name, ts in times.items():
        print(f"{name:32s} {1e3 * statistics.median(ts):8.2f} ms")
    for baseline in [v.name for v in variants if v.name != "channels_last backward"]:
        ratios = [a / b for a, b in zip(times["channels_last backward"], times[baseline])]
        low, high = bench.median_interval(ratios)
        print(f"channels_last backward / {baseline:32s} {statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    main()
