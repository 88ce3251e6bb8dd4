"""kvtier's benchmark: ``kvtier bench`` / ``python -m kvtier bench``.

* `kvtier.bench.core`: the runs (kvtier against the raw copy, alternating;
  single and bulk paths; the scaling table) and the CLI;
* `kvtier.bench.settings`: what a run measures (shapes, sizes, the modes);
* `kvtier.bench.measures`: the instruments (the event-loop monitor: lag,
  collections, every callback timed; an executor that copies nothing) and the
  summaries of their readings;
* `kvtier.bench.loop` / `kvtier.bench.lean`: the loop-thread cost per
  operation, and the lean scheduler it is compared with;
* `kvtier.bench.copies`: the hand-written raw copies kvtier is compared with;
* `kvtier.bench.report`: the text report, the targets and the plot, from the JSON;
* `kvtier.bench.storage`: the storage section (host pages to Redis and to files);
* `kvtier.bench.redis`: `RedisStore` alone against a raw redis-py pipeline
  (``python -m kvtier.bench.redis``).
"""

from kvtier.bench.core import main, parse_args, run_bench
from kvtier.bench.measures import LoopLagMonitor

__all__ = ["LoopLagMonitor", "main", "parse_args", "run_bench"]
