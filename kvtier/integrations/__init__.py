"""Bridges between kvtier pools and the cache objects of model libraries.

Each integration lives in its own module and imports its library lazily, so
``import kvtier`` never needs it:

* `kvtier.integrations.hf`: Hugging Face `transformers` caches
  (``pip install 'kvtier[hf]'``): `HFCacheBridge` for ``DynamicCache`` layers,
  `DeepseekV4CacheBridge` for DeepSeek V4 into the stack of
  `kvtier.presets.deepseek_v4`.
"""

__all__: list[str] = []
