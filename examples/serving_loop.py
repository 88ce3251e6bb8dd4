"""The serving-loop demo, from a checkout: ``python examples/serving_loop.py [options]``.

The demo ships with the package (`kvtier.demo`, also ``kvtier demo``): its
module is the pattern to read and copy for a hybrid model's serving loop
(pools from the DeepSeek V4 preset, backups, loads into fresh slots, two
engines sharing a store). This script only runs it.
"""

import sys

from kvtier.demo import main

if __name__ == "__main__":
    sys.exit(main())
