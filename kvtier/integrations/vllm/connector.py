"""`KvtierOffloadingSpec` (vLLM's offloading spec) and `KvtierConnector`.

`KvtierOffloadingSpec` plugs kvtier into vLLM's `OffloadingConnector`:
the scheduler side gets a `KvtierOffloadingManager`, the worker side a
`KvtierOffloadingWorker`. `KvtierConnector` is vLLM's `OffloadingConnector`
plus one thing it lacks: it reports the blocks of a load that did not land
(verify mode refused changed bytes, or a stored block vanished) through
``get_block_ids_with_load_errors``, so that vLLM recomputes them
(``kv_load_failure_policy="recompute"``). With a store or verify mode on, the
spec requires it. It also checks each KV cache group's kind before vLLM
builds anything, which a model of several groups (hybrid) needs
(`kvtier.integrations.vllm.groups`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.errors import ConfigurationError
from kvtier.integrations.vllm.groups import GroupInfo, check_groups, group_infos, group_layout
from kvtier.integrations.vllm.loop import ShardGeometry, StorageKeys, StoreClient, probe_store
from kvtier.integrations.vllm.manager import KvtierOffloadingManager, StoreLookup
from kvtier.integrations.vllm.metrics import KvtierWorkerMetadata, metric_definitions, worker_counts, zero_counts
from kvtier.integrations.vllm.options import (
    DEFAULT_STAGING_BLOCKS,
    KvtierOptions,
    check_offloading_backend,
    host_blocks,
    parse_options,
)
from kvtier.integrations.vllm.worker import KvtierOffloadingWorker
from kvtier.policies import make_admission

__all__ = ["KvtierConnector", "KvtierOffloadingSpec", "LMCacheBackendRefused", "LoadJobs", "offloading_size_of"]


# The KV cache groups `KvtierConnector` checked, while it builds vLLM's
# connector (and with it the spec): vLLM's OffloadingConfig names no group's kind.
_CHECKED_GROUPS: ContextVar[tuple[GroupInfo, ...] | None] = ContextVar("kvtier_vllm_checked_groups", default=None)

# Set while a `KvtierConnector` builds its spec (on this thread), so that the
# spec can tell, at construction, whether failed loads will be reported.
_building = threading.local()

NEEDS_KVTIER_CONNECTOR = (
    "kvtier's verify mode and store need kv_connector='KvtierConnector' "
    "(kv_connector_module_path='kvtier.integrations.vllm', kv_load_failure_policy='recompute'), "
    "which lets vLLM recompute a block whose load kvtier refused"
)


def release_vllm_connector(spec: OffloadingSpec) -> None:
    """Drop vLLM's module-level connector agent when it is the one built with
    ``spec``: vLLM keeps the worker's connector in module state before the
    worker registers its KV caches, so a connector that fails after that
    would be handed to every later engine of this process."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    if not kv_transfer_state.has_kv_transfer_group():
        return
    agent = kv_transfer_state.get_kv_transfer_group()
    worker = getattr(agent, "connector_worker", None)
    if worker is not None and getattr(worker, "spec", None) is spec:
        kv_transfer_state.ensure_kv_transfer_shutdown()


def _name_kvtier_spec(extra: dict[str, Any]) -> None:
    """Have vLLM's offloading connector build kvtier's spec (unless another is named)."""
    extra.setdefault("spec_name", KvtierOffloadingSpec.__name__)
    extra.setdefault("spec_module_path", "kvtier.integrations.vllm")


def offloading_size_of(vllm_config: Any) -> float | None:
    """vLLM's ``--kv-offloading-size`` (``kv_offloading_size``, GiB), when set.

    vLLM 0.32 then renames ``kv_connector`` to its own ``OffloadingConnector``
    (kvtier's package answers that name with `KvtierConnector`) and sets
    ``cpu_bytes_to_use`` to the size in bytes, in place of any given. Its
    ``--kv-offloading-backend`` must be ``"native"`` (its default): ``"lmcache"``
    names LMCache's connector instead, which kvtier refuses (`LMCacheBackendRefused`).
    """
    cache = getattr(vllm_config, "cache_config", None)
    size = getattr(cache, "kv_offloading_size", None)
    if size is None:
        return None
    check_offloading_backend(getattr(cache, "kv_offloading_backend", "native"))
    return float(size)


class LMCacheBackendRefused(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]
    """What kvtier's package answers for ``LMCacheMPConnector``: vLLM's
    ``--kv-offloading-backend lmcache`` renames ``kv_connector`` to it and
    keeps ``kv_connector_module_path`` (kvtier's). Refuses to start with
    one line naming the flag (`check_offloading_backend`). A subclass of
    vLLM's connector base, so that vLLM's checks of the class before it
    builds one pass; refused in ``__new__``, before the base's abstract
    methods would be."""

    def __new__(cls, vllm_config: Any, role: Any = None, kv_cache_config: Any = None) -> LMCacheBackendRefused:
        backend = getattr(getattr(vllm_config, "cache_config", None), "kv_offloading_backend", None)
        check_offloading_backend("lmcache" if backend in (None, "native") else backend)
        raise AssertionError("unreachable: check_offloading_backend refuses every backend but 'native'")


class KvtierOffloadingSpec(OffloadingSpec):  # type: ignore[misc,unused-ignore]
    """vLLM's `OffloadingSpec` for kvtier. Options: `kvtier.integrations.vllm.options`.

    Checks everything at construction, on both sides, so a bad configuration
    fails at engine start with a `ConfigurationError` naming the option, before
    vLLM keeps the connector: verify mode or a store without `KvtierConnector`,
    and a store that cannot take and give back a probe page (`probe_store`).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvtier's metrics on vLLM's ``/metrics`` (`kvtier.integrations.vllm.metrics`)."""
        return metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options: KvtierOptions = parse_options(self.extra_config)
        # True when a KvtierConnector builds this spec (it reports failed loads).
        self.reports_load_errors: bool = getattr(_building, "active", False)
        if (self.options.verify or self.options.has_store) and not self.reports_load_errors:
            raise ConfigurationError(NEEDS_KVTIER_CONNECTOR)
        self.group_ids = tuple(g.group_id for g in config.groups)
        checked = _CHECKED_GROUPS.get()
        self.group_kinds = {g.group_id: g.kind for g in checked or ()}
        if len(config.groups) > 1:
            if checked is None:
                raise ConfigurationError(
                    f"kvtier moves a model of several KV cache groups (this one has {len(config.groups)}) only under "
                    "kv_connector='KvtierConnector' (kv_connector_module_path='kvtier.integrations.vllm'), which "
                    "checks each group's kind; vLLM's plain OffloadingConnector tells the spec no group's kind"
                )
            if tuple(g.group_id for g in checked) != self.group_ids:
                raise ConfigurationError(
                    f"vLLM's offloading config names KV cache groups {list(self.group_ids)}; "
                    f"KvtierConnector checked {[g.group_id for g in checked]}"
                )
        if self.blocks_per_chunk != 1:
            raise ConfigurationError(
                f"kvtier moves one vLLM block per host block; got blocks_per_chunk={self.blocks_per_chunk} "
                "(leave 'block_size' and 'blocks_per_chunk' out of kv_connector_extra_config)"
            )
        parallel = config.parallel
        if self.options.has_store and (parallel.pcp_size != 1 or parallel.dcp_size != 1):
            # Tensor and pipeline parallel shards are tested (tests/vllm); a
            # context-parallel engine's shards are not, so it is refused.
            raise ConfigurationError(
                f"kvtier option {'store_path' if self.options.store_path else 'redis_url'!r} works with tensor and "
                f"pipeline parallel workers, not context parallel ones; this engine has "
                f"prefill_context_parallel_size={parallel.pcp_size}, decode_context_parallel_size={parallel.dcp_size}"
            )
        self.block_bytes = int(config.worker_kv_bytes_per_block)
        # vLLM's --kv-offloading-size (None without it): GiB over all of vLLM's workers.
        self.offloading_size: float | None = getattr(_building, "offloading_size", None)
        self.num_host_blocks = host_blocks(self.options, self.extra_config, self.block_bytes,
                                           offloading_size=self.offloading_size, workers=int(config.parallel.world_size))
        # Built here, on both sides, so that a factory that cannot be imported fails the start.
        self.admission = make_admission(self.options.store_admission, sightings=self.options.admission_sightings,
                                        window=self.options.admission_window)
        probe_store(self.options)
        self.staging_blocks = self.options.staging_blocks or min(self.num_host_blocks, DEFAULT_STAGING_BLOCKS)
        group = config.groups[0]
        model = self.options.model_identity or f"{config.model.name}|{config.model.dtype}"
        # One shard per worker: the scheduler side names a block by its key,
        # each worker (``rank``) stores and loads its own shard's key.
        self.rank = int(parallel.rank)
        world = ShardGeometry(world_size=parallel.world_size, tp_size=parallel.tp_size, pp_size=parallel.pp_size)
        self.storage_keys = StorageKeys(
            model=model, block_size=group.tokens_per_block, dtype=config.model.dtype,
            num_layers=len(group.layer_names), block_bytes=self.block_bytes, groups=group_layout(config.groups),
            world=world,
        )
        self._manager: KvtierOffloadingManager | None = None
        self._store_client: StoreClient | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> KvtierOffloadingManager:
        if self._manager is None:
            lookup = None
            if self.options.has_store:
                self._store_client = StoreClient(self.options, timeout_s=self.options.lookup_timeout_s)
                lookup = StoreLookup(self._store_client.exists, self.storage_keys, shards=self.storage_keys.shards,
                                     close=self._store_client.close)
            zeros = zero_counts(verify=self.options.verify, store=self.options.has_store,
                                frequency_gate=self.options.store_admission == "frequency")
            self._manager = KvtierOffloadingManager(
                self.num_host_blocks, store=lookup, admission=self.admission, eviction=self.options.host_eviction,
                zero_counts=zeros,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvtierOffloadingWorker:
        if self._worker is None:
            try:
                self._worker = KvtierOffloadingWorker(
                    kv_caches, host_blocks=self.num_host_blocks, options=self.options,
                    staging_blocks=self.staging_blocks, group_ids=self.group_ids,
                    group_kinds=self.group_kinds, block_bytes=self.block_bytes, rank=self.rank,
                    shard=functools.partial(self.storage_keys.shard, rank=self.rank),
                    identity=self.storage_keys.identity(self.rank),
                )
            except BaseException:
                # vLLM holds this connector in module state by now: a failed start leaves it clean.
                release_vllm_connector(self)
                raise
        return self._worker

    def shutdown(self) -> None:
        """End what this spec started, on either side (idempotent)."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._manager is not None:
            self._manager.shutdown()
        if self._store_client is not None:
            self._store_client.close()
            self._store_client = None


def store_again(scheduler: Any, req_ids: Collection[str], keys: Collection[bytes]) -> int:
    """Have vLLM's offloading scheduler store again, once recomputed, the blocks
    ``keys`` of the requests ``req_ids`` whose load failed; returns how many
    requests' store positions moved back.

    vLLM's scheduler moves a request's store position (``next_stored_chunk_idx``)
    past the blocks it asks to load, so a block whose load failed, and which vLLM
    then recomputes, is never stored again by that request: the store would keep
    the damaged (or missing) copy, and every engine after would refuse it too.
    Moving the position back to the first failed block makes the next store job
    of the request write the recomputed blocks, and the write-through puts them
    (``RewriteKeys``). Reads vLLM 0.32's scheduler state (``_req_status``,
    ``group_states``); another layout leaves the positions as they are.
    """
    failed = set(keys)
    moved = 0
    states = getattr(scheduler, "_req_status", None) or {}
    for req_id in req_ids:
        status = states.get(req_id)
        for group in getattr(status, "group_states", ()) or ():
            first = next((i for i, key in enumerate(group.offload_keys) if key in failed), None)
            if first is not None and first < group.next_stored_chunk_idx:
                group.next_stored_chunk_idx = first
                moved += 1
    return moved


class LoadJobs:
    """The scheduler side's load jobs in flight: device block -> vLLM's key,
    until each of ``num_workers`` workers has reported the job.

    With tensor or pipeline parallelism every worker loads its own shard of
    each block and reports its own completion and its own failed blocks, in
    its own step: vLLM's aggregator sums the completions and unites the failed
    blocks of one step. `report` names each key a worker failed to load once,
    whichever worker and step reported it; vLLM recomputes the block on every
    worker (its scheduler truncates the request at the first failed block),
    and kvtier's manager no longer offers it.
    """

    def __init__(self, num_workers: int) -> None:
        # vLLM's world size, validated by vLLM before it reaches here: an invariant, not user input.
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1; got {num_workers!r}")
        self.num_workers = num_workers
        self._blocks: dict[int, dict[int, bytes]] = {}
        self._pending: dict[int, int] = {}

    def add(self, job_id: int, blocks: dict[int, bytes]) -> None:
        self._blocks[job_id] = dict(blocks)
        self._pending[job_id] = self.num_workers

    def report(self, completed: Mapping[int, int], invalid: Collection[int]) -> list[bytes]:
        """One step's reports (job id -> workers that completed it, failed
        device blocks); the keys of failed blocks not named before."""
        refused: list[bytes] = []
        for job_id, count in completed.items():
            blocks = self._blocks.get(job_id)
            if blocks is None:
                continue  # a store job, or one from before a reset
            for block in [b for b in blocks if b in invalid]:
                refused.append(blocks.pop(block))
            pending = self._pending[job_id] - int(count)
            if pending > 0:
                self._pending[job_id] = pending
            else:
                del self._blocks[job_id], self._pending[job_id]
        return refused

    def clear(self) -> None:
        self._blocks.clear()
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._blocks)


class KvtierConnector(OffloadingConnector):  # type: ignore[misc,unused-ignore]
    """vLLM's `OffloadingConnector` with kvtier's spec, reporting failed loads.

    ``spec_name`` / ``spec_module_path`` default to kvtier's spec. vLLM must
    run with ``kv_load_failure_policy="recompute"`` (checked here). With
    vLLM's ``--kv-offloading-size`` (vLLM then asks kvtier's package for its
    ``OffloadingConnector``, and gets this class) the host tier is that size
    over all workers (`offloading_size_of`, `host_blocks`).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer = vllm_config.kv_transfer_config
        _name_kvtier_spec(transfer.kv_connector_extra_config)
        # vLLM's --kv-offloading-size: vLLM put it into cpu_bytes_to_use (GiB over all workers).
        offloading_size = offloading_size_of(vllm_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigurationError(
                f"KvtierConnector needs kv_load_failure_policy='recompute' (a block kvtier refuses is recomputed); "
                f"got {transfer.kv_load_failure_policy!r}"
            )
        # Checked before vLLM builds (and keeps) anything; the spec, built
        # inside, reads the checked groups (its own config names no kinds).
        groups = group_infos(kv_cache_config) if kv_cache_config is not None else None
        if groups is not None:
            check_groups(groups)
        token = _CHECKED_GROUPS.set(groups)
        _building.active = True
        _building.offloading_size = offloading_size
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _building.active = False
            _building.offloading_size = None
            _CHECKED_GROUPS.reset(token)
        # Scheduler side: the load jobs in flight, until every worker reported them.
        self._loads = LoadJobs(int(vllm_config.parallel_config.world_size))
        # Worker side: the worker's counts as last sent to the scheduler side.
        self._sent_counts: dict[str, int] = {}

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's Prometheus metrics for this connector, kvtier's among them.

        vLLM builds them in its front-end process from the extra config,
        which in multiprocess mode never saw `__init__` (that runs in the
        engine-core process) name kvtier's spec: its metric definitions would
        be the CPU spec's, and the first kvtier count would fail vLLM's stat
        logger (``assert key in self._offloading_metric_defs``)."""
        _name_kvtier_spec(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return super().build_prom_metrics(vllm_config, *args, **kwargs)

    # -- scheduler side: drop what a refused load named -----------------------------

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for job_id, job in meta.load_jobs.items():
            keys = getattr(job.src_spec, "offload_keys", None)
            if keys is not None:
                self._loads.add(job_id, dict(zip(job.dst_spec.block_ids.tolist(), keys, strict=True)))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        counts = getattr(connector_output.kv_connector_worker_meta, "kvtier", None)
        meta = connector_output.kv_connector_worker_meta
        completed = getattr(meta, "completed_jobs", None) or {}
        refused = self._loads.report(completed, connector_output.invalid_block_ids or ())
        # The requests whose loads end now (vLLM forgets the jobs in super()).
        jobs = getattr(self.connector_scheduler, "_jobs", None) or {}
        loading = {jobs[j].req_id for j in completed if j in jobs and not jobs[j].is_store} if refused else set()
        super().update_connector_output(connector_output)
        manager = self.connector_scheduler.manager if self.connector_scheduler is not None else None
        if refused and isinstance(manager, KvtierOffloadingManager):
            manager.refuse(refused)
            store_again(self.connector_scheduler, loading, refused)
        if counts and isinstance(manager, KvtierOffloadingManager):
            manager.report_worker(counts)

    def reset_cache(self) -> bool | None:
        self._loads.clear()
        result: bool | None = super().reset_cache()
        return result

    # -- worker side -------------------------------------------------------------------

    def build_connector_worker_meta(self) -> Any:
        """vLLM's metadata for this step, with kvtier's counts since the last
        one (for the scheduler side's stats, vLLM's ``/metrics``)."""
        meta = super().build_connector_worker_meta()
        worker = self.connector_worker
        kvtier = worker.worker if worker is not None else None
        if not isinstance(kvtier, KvtierOffloadingWorker):
            return meta
        now = worker_counts(kvtier.statistics(schedulers=False))
        delta = {k: n - self._sent_counts.get(k, 0) for k, n in now.items() if n != self._sent_counts.get(k, 0)}
        if not delta:
            return meta
        self._sent_counts = now
        out = KvtierWorkerMetadata(kvtier=delta)
        if meta is not None:
            out.completed_jobs, out.transfer_stats = meta.completed_jobs, meta.transfer_stats
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        if worker is None or worker.worker is None or not isinstance(worker.worker, KvtierOffloadingWorker):
            return set()
        return worker.worker.take_invalid_blocks()

    def shutdown(self) -> None:
        # vLLM's own: the worker's shutdown, and the manager's (its store lookups' thread).
        super().shutdown()
        worker = self.connector_worker
        if worker is not None and isinstance(worker.spec, KvtierOffloadingSpec):
            worker.spec.shutdown()
