"""The float32 tanh pass against the correctly rounded tanh, on every float32 input, and its
speed against torch's.

    python benchmarks/tanh_accuracy.py [--negative] [--json PATH]

Every non-negative float32 bit pattern (2³¹ of them, with +inf and the NaNs; ``--negative`` adds
the other 2³¹) goes through the pass (``affdiv.layers._fused.tanh``) and through torch's float32
tanh, in chunks, and each result is compared with the correctly rounded value (:func:`misrounded`):
torch's float64 tanh (within an ulp of float64) rounded once to float32, or, where that lies too
near a rounding boundary to tell, mpmath's tanh at 160 bits. Printed and written: how many of each
were not the correctly rounded value and by how many units in the last place at most
(:func:`ulps_apart`), how many mpmath decided, and the time per element of each in the same run
(one thread; the two timed in turn, each first in every other chunk) and their ratio. About five
minutes for the non-negative half on one core.
"""

from __future__ import annotations

import argparse
import time

import mpmath
import torch
from tqdm import tqdm

from affdiv.atomic import check_writable_file
from affdiv.experiments.runs.sweep import keep_freed_memory
from affdiv.layers import _fused
from affdiv.provenance import provenance
from affdiv.reporting import write_json

#: Where the float64 reference lies within this (relative) of the midpoint of two floats, it may
#: not tell which of them is the correctly rounded one (its own error is about 1e-16): there
#: mpmath decides, at 160 bits.
NEAR_A_MIDPOINT = 2.0 ** -44
CHUNK = 1 << 24


def correctly_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, near) for float32 inputs x (1-D): the correctly rounded float32 tanh(x), and where
    the float64 reference lay within ``NEAR_A_MIDPOINT`` of a rounding boundary, so that mpmath
    decided."""
    reference = torch.tanh(x.double())
    rounded = reference.float()
    neighbour = torch.where(reference >= rounded.double(), torch.nextafter(rounded, torch.tensor(float("inf"))),
                            torch.nextafter(rounded, torch.tensor(float("-inf"))))
    midpoint = (rounded.double() + neighbour.double()) / 2
    near = (reference - midpoint).abs() <= NEAR_A_MIDPOINT * reference.abs()
    for i in near.nonzero().flatten().tolist():
        rounded[i] = _nearer_to_tanh(float(x[i]), float(rounded[i]), float(neighbour[i]))
    return rounded, near


def misrounded(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wrong, near) for float32 tanh values y of x (1-D): wrong where y is not the correctly
    rounded tanh(x), and ``near`` as :func:`correctly_rounded`'s."""
    correct, near = correctly_rounded(x)
    return differs(y, correct), near


def differs(y: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Where y is not ``correct`` (NaN for NaN)."""
    return (y != correct) & ~(y.isnan() & correct.isnan())


def ulps_apart(y: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """The distance from ``correct`` to y in units in the last place: the steps between them along
    the float32 values ordered by value (0 where equal, −0 and +0 equal, and where both are NaN;
    2³² where only one is, farther than any two floats)."""
    def ordered(v: torch.Tensor) -> torch.Tensor:
        bits = v.view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    apart = (ordered(y) - ordered(correct)).abs()
    return torch.where(y.isnan() | correct.isnan(), 2**32 * (y.isnan() != correct.isnan()), apart)


def _nearer_to_tanh(x: float, a: float, b: float) -> float:
    """Of the floats a and b, the one nearer tanh(x) (tanh of a nonzero float is irrational, so
    never a tie)."""
    with mpmath.workprec(160):
        t = mpmath.tanh(mpmath.mpf(x))
        return a if abs(t - a) < abs(t - b) else b


def as_float32(bits: torch.Tensor) -> torch.Tensor:
    """The float32 values of the bit patterns ``bits`` (int64, unsigned 32-bit values)."""
    return (bits - 2**32 * (bits >= 2**31)).to(torch.int32).view(torch.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--negative", action="store_true", help="also every negative bit pattern")
    parser.add_argument("--json", help="write the counts, timings and provenance here")
    args = parser.parse_args(argv)
    if args.json:
        check_writable_file(args.json, "--json")
    if not _fused.available():
        parser.error("the fused CPU passes are not built here: nothing to check")
    torch.set_num_threads(1)
    keep_freed_memory()  # (each chunk's temporaries reuse the last's memory)
    total = 2**32 if args.negative else 2**31
    counts = {name: {"wrong": 0, "near": 0, "most_ulps": 0} for name in ("pass", "torch")}
    seconds = {"pass": 0.0, "torch": 0.0}
    examples = []
    for chunk, start in enumerate(tqdm(range(0, total, CHUNK), desc="bit patterns", unit="chunk")):
        x = as_float32(torch.arange(start, min(start + CHUNK, total), dtype=torch.int64))
        correct, near = correctly_rounded(x)
        for name, tanh in (("pass", _fused.tanh), ("torch", torch.tanh))[:: 1 if chunk % 2 == 0 else -1]:
            begin = time.perf_counter()
            y = tanh(x)
            seconds[name] += time.perf_counter() - begin
            wrong = differs(y, correct)
            counts[name]["wrong"] += int(wrong.sum())
            counts[name]["near"] += int(near.sum())
            counts[name]["most_ulps"] = max(counts[name]["most_ulps"], int(ulps_apart(y, correct).max()))
            if name == "pass" and wrong.any():  # (the first ten, as bit patterns: NaNs too)
                pairs = zip(x[wrong][:10].view(torch.int32).tolist(), y[wrong][:10].view(torch.int32).tolist())
                examples = (examples + list(pairs))[:10]
    ns = {name: 1e9 * s / total for name, s in seconds.items()}
    for name in ("pass", "torch"):
        print(f"{name:5s}: {counts[name]['wrong']} of {total} inputs not correctly rounded, at most "
              f"{counts[name]['most_ulps']} ulp(s) off "
              f"({counts[name]['near']} within {NEAR_A_MIDPOINT:.1e} of a boundary, decided by mpmath), "
              f"{ns[name]:.3f} ns an element")
    print(f"torch / pass time per element: {ns['torch'] / ns['pass']:.2f}")
    if args.json:
        write_json(args.json, {"inputs": total, "counts": counts, "ns_per_element": ns,
                               "torch_over_pass": ns["torch"] / ns["pass"], "pass_wrong_examples_bits": examples,
                               "provenance": provenance(threads=1)})
    return 1 if counts["pass"]["wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
