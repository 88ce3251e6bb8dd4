"""Pool-stack presets: a model's pools planned from its config, sized like engines size them.

* `PoolStack` / `PoolPlan`: any stack, sized by ``host_ratio``, ``host_bytes``
  or ``host_slots`` and registered in a `PoolGroup` in one call;
* `anchor_with_sidecars` and `shared_anchor`: the two generic shapes;
* `deepseek_v4` / `deepseek_v4_stack`: the DeepSeek V4 stack (logical anchor,
  ``c4`` / ``c4_indexer`` / ``c128`` sidecars, the window with its own pages,
  compressor state; pools named by role, ``roles=`` renames them).

Nothing here imports transformers.
"""

from kvtier.presets.deepseek_v4 import DeepseekV4Lengths, DeepseekV4Stack, deepseek_v4, deepseek_v4_stack
from kvtier.presets.stack import PoolPlan, PoolStack, StackSizes, anchor_with_sidecars, shared_anchor

__all__ = [
    "DeepseekV4Lengths",
    "DeepseekV4Stack",
    "PoolPlan",
    "PoolStack",
    "StackSizes",
    "anchor_with_sidecars",
    "deepseek_v4",
    "deepseek_v4_stack",
    "shared_anchor",
]
