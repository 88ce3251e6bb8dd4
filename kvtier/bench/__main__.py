"""``python -m kvtier.bench``: the same as ``kvtier bench``."""

import sys

from kvtier.bench.core import main

sys.exit(main())
