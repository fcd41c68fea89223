"""`affdiv bench layers`: time the corrected layers against their baselines (see layers.benchmark)."""

from __future__ import annotations

import argparse
from pathlib import Path

from affdiv.atomic import check_writable_file


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="timing benchmarks")
    targets = bench.add_subparsers(dest="bench_target", metavar="TARGET", required=True)
    layers = targets.add_parser(
        "layers",
        help="forward+backward time of the corrected layers as ratios to baselines measured in the same run",
    )
    add_arguments(layers)
    layers.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke test)")
    parser.add_argument("--threads", type=_int_at_least(1), default=2, metavar="N",
                        help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=_int_at_least(1), default=None, metavar="R",
                        help="timed rounds (default 25, quick 3)")
    parser.add_argument("--warmup", type=_int_at_least(0), default=None, metavar="W",
                        help="untimed rounds first (default 3, quick 1)")
    parser.add_argument("--compile-backend", default="inductor", metavar="NAME",
                        help="torch.compile backend of the naive composites (default inductor)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the results (with provenance) here (default: not written)")


def _int_at_least(minimum: int):
    """argparse type: an int >= minimum, else a usage error naming both."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        return value
    return parse


def check_backend(name: str) -> str:
    """``name`` if torch.compile knows a backend of that name, else a ValueError listing them."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(f"--compile-backend {name!r}: not a torch.compile backend; expected one of: "
                         f"{', '.join(torch._dynamo.list_backends())} (or another of {len(known)} registered ones)")
    return name


def main(args: argparse.Namespace) -> int:
    from affdiv.layers import benchmark
    from affdiv.provenance import provenance

    # Settings and the output path are checked before the minutes of timing, not after.
    check_backend(args.compile_backend)
    if args.json is not None:
        check_writable_file(args.json, "--json")
    result = benchmark.run(quick=args.quick, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
                           backend=args.compile_backend, progress=lambda line: print(line, flush=True))
    print(benchmark.format_table(result["rows"]))
    if args.json is not None:
        benchmark.write_result(args.json, result, provenance(benchmark="layers"))
        print(f"wrote {args.json}")
    return 0
