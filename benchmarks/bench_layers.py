"""Time the corrected layers on CPU (same as `affdiv bench layers`); see affdiv.layers.benchmark.

    python benchmarks/bench_layers.py [--quick] [--threads 2] [--json out.json]
"""

import argparse
import sys

from affdiv.layers import cli

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    sys.exit(cli.main(parser.parse_args()))
