"""``python -m affdiv``: the `affdiv` command line."""

import sys

from affdiv.cli import main

sys.exit(main())
