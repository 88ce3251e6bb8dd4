"""A small paged-attention engine that keeps shared prefixes in kvtier's host tier.

The engine is plain torch: a decoder-only transformer (RMSNorm, RoPE, SwiGLU,
random float32 weights) whose attention reads K and V straight from the rows of
a kvtier `DevicePool` by slot index (paged attention). Its device pool holds one
long shared prefix ("system prompt") at a time, and requests alternate between
two of them, so serving one prefix evicts the other:

* a prefix computed for the first time is backed up to the host right away
  (write-through, off the critical path); evicting it later only waits for that
  backup and frees its device pages;
* a request whose prefix lives only on the host issues ``sched.load(...)``
  (kvtier takes the device pages from the engine's allocator and calls the
  engine's eviction hook when it is short) and runs its forward pass layer by
  layer, awaiting ``load.layer_ready(i)`` before layer ``i``: later layers
  load while earlier layers compute.

Per request it prints the prefix tokens reused from the host tier and the time
saved against recomputing the prefix; then it checks every token and every
logit (``torch.equal``) against a run whose device pool is large enough that
nothing is ever evicted, and exits with status 1 on a mismatch.

Run: ``python examples/paged_engine.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import anyio
import torch

from kvtier import (
    DevicePool,
    KvtierError,
    OperationHandle,
    PageAllocator,
    PoolGroup,
    TransferScheduler,
)


@dataclass
class Options:
    prefix_tokens: int = 512  # per shared prefix; a whole number of pages
    suffix_tokens: int = 32  # each request's own prompt after the prefix
    new_tokens: int = 8  # greedy tokens generated per request
    requests: int = 6  # alternating between the prefixes
    prefixes: int = 2
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    page_size: int = 16
    vocab: int = 512
    seed: int = 0
    corrupt: bool = False  # alter one host page of the first prefix, to see the check fail


# -- the model: plain torch, weights only ----------------------------------------


class TinyTransformer:
    """Decoder-only transformer; the engine drives it one layer at a time."""

    def __init__(self, opt: Options) -> None:
        g = torch.Generator().manual_seed(opt.seed)
        d, self.heads = opt.hidden, opt.heads
        self.head_dim = d // opt.heads

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g) / math.sqrt(shape[-1])

        self.embed = torch.randn((opt.vocab, d), generator=g)
        self.layers = [
            {"qkv": w(3 * d, d), "o": w(d, d), "up": w(4 * d, d), "down": w(d, 2 * d)} for _ in range(opt.layers)
        ]
        self.head = w(opt.vocab, d)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.inv_freq = inv

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq  # [n, head_dim/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        q, k, v = (self.norm(x) @ self.layers[i]["qkv"].T).view(n, 3, self.heads, self.head_dim).unbind(1)
        return self.rope(q, positions), self.rope(k, positions), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention of queries at positions ``start..`` over keys ``0..``."""
        n, total = q.shape[0], keys.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(self.head_dim)
        future = torch.arange(total)[None, :] > (start + torch.arange(n))[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, values).reshape(n, -1)

    def finish_layer(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = self.layers[i]
        x = x + attn @ p["o"].T
        gate, up = (self.norm(x) @ p["up"].T).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ p["down"].T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x[-1:]) @ self.head.T


# -- the engine -------------------------------------------------------------------


@dataclass(eq=False)
class Prefix:
    """A shared prefix: its device pages while resident, its host copy once backed up."""

    name: str
    tokens: torch.Tensor
    device: torch.Tensor | None = None
    host: dict[str, torch.Tensor] | None = None
    backup: OperationHandle | None = None
    users: int = 0
    last_used: int = 0
    recompute_s: float = 0.0  # what computing it took, the cost a host hit avoids


@dataclass
class RequestReport:
    request: int
    prefix: str
    source: str  # "computed" | "device" | "host"
    tokens_from_host: int
    load_ms: float  # the load from submission to its last layer
    exposed_ms: float  # the part of it on the request's critical path
    recompute_ms: float
    saved_ms: float
    generated: list[int] = field(default_factory=list)


class PagedEngine:
    """Serves requests over one kv `DevicePool`: per layer K and V, ``[slots, heads, head_dim]``.

    With ``offload`` the engine backs prefixes up to kvtier's host pool and
    reloads them; without it, it never evicts (and fails if the pool is short).
    """

    def __init__(self, model: TinyTransformer, opt: Options, device_pages: int, *, offload: bool) -> None:
        self.model, self.opt, self.offload = model, opt, offload
        ps = opt.page_size
        slots = device_pages * ps
        self.alloc = PageAllocator(slots, ps, name="kv")
        plane = (opt.heads, opt.hidden // opt.heads)
        self.kv = DevicePool(
            [[torch.zeros((slots, *plane)), torch.zeros((slots, *plane))] for _ in range(opt.layers)],
            allocator=self.alloc,
        )
        self.group = PoolGroup()
        prefix_pages = opt.prefix_tokens // ps
        self.group.add_pool("kv", device=self.kv, page_size=ps, host_slots=opt.prefixes * prefix_pages * ps)
        self.sched: TransferScheduler | None = None
        self.prefixes: dict[str, Prefix] = {}
        self.clock = 0
        self.evictions = 0
        self.corrupt_next_eviction = opt.corrupt

    # -- memory ------------------------------------------------------------------

    async def reclaim(self, pool: str, tier: str, slots_needed: int) -> None:
        """kvtier's reclaim hook (and the engine's own): evict idle prefixes,
        least recently used first, until ``slots_needed`` device slots are free."""
        if tier != "device":
            return
        idle = sorted((p for p in self.prefixes.values() if p.device is not None and not p.users),
                      key=lambda p: p.last_used)
        for victim in idle:
            if self.alloc.num_free_slots >= slots_needed:
                return
            await self.evict(victim)

    async def evict(self, prefix: Prefix) -> None:
        if not self.offload or prefix.backup is None:
            raise RuntimeError(f"prefix {prefix.name} would be lost: this engine does not offload")
        await prefix.backup  # the backup reads these rows: free them only once it is done
        if self.corrupt_next_eviction:  # --corrupt: one page altered on the host, in transit
            self.corrupt_next_eviction = False
            assert prefix.host is not None
            self.group["kv"].host.layer_view(0, 0)[prefix.host["kv"][: self.opt.page_size]] += 1.0
        assert prefix.device is not None
        self.alloc.free(prefix.device)
        prefix.device = None
        self.evictions += 1

    async def allocate(self, slots: int) -> torch.Tensor:
        got = self.alloc.try_alloc(slots)
        if got is None:
            await self.reclaim("kv", "device", slots)
            got = self.alloc.try_alloc(slots)
        if got is None:
            raise RuntimeError(f"device pool short of {slots} slots with nothing left to evict")
        return got

    # -- the forward pass ----------------------------------------------------------

    async def forward(
        self, tokens: torch.Tensor, start: int, page_table: torch.Tensor, load: OperationHandle | None
    ) -> tuple[torch.Tensor, float]:
        """Run ``tokens`` (positions ``start..``) through every layer, writing their
        K and V to ``page_table[start:]`` and reading keys ``0..`` from the pool.
        Before layer ``i`` it awaits ``load.layer_ready(i)``. Returns the last
        position's logits and the seconds spent waiting for layers."""
        m, n = self.model, tokens.shape[0]
        positions = torch.arange(start, start + n)
        mine, visible = page_table[start : start + n], page_table[: start + n]
        x = m.embed[tokens]
        waited = 0.0
        for i in range(self.opt.layers):
            if load is not None:
                t0 = time.perf_counter()
                await load.layer_ready(i)  # layer i of the prefix is in its device rows
                waited += time.perf_counter() - t0
            q, k, v = m.qkv(i, x, positions)
            keys, values = self.kv.tensor(i, 0), self.kv.tensor(i, 1)
            keys[mine], values[mine] = k, v
            attn = m.attend(q, keys.index_select(0, visible), values.index_select(0, visible), start)
            x = m.finish_layer(i, x, attn)
        return m.logits(x), waited

    # -- serving -----------------------------------------------------------------

    async def prefix_pages(self, prefix: Prefix) -> tuple[torch.Tensor, OperationHandle | None, str, float]:
        """Device pages holding ``prefix``: resident, loaded from the host, or computed.
        Returns them, the load to await per layer (or None), the source, and the
        seconds spent on the critical path getting them before the forward pass."""
        assert self.sched is not None
        t0 = time.perf_counter()
        if prefix.device is not None:
            return prefix.device, None, "device", 0.0
        if prefix.host is not None:
            # kvtier takes the pages from our allocator (our reclaim hook runs if short).
            load = await self.sched.load(prefix.host)
            prefix.device = load.device_indices["kv"]
            return prefix.device, load, "host", time.perf_counter() - t0
        prefix.device = await self.allocate(prefix.tokens.numel())
        t1 = time.perf_counter()
        await self.forward(prefix.tokens, 0, prefix.device, None)
        prefix.recompute_s = time.perf_counter() - t1
        if self.offload:  # write-through: the copy runs while this request goes on
            prefix.backup = await self.sched.backup({"kv": prefix.device})
            prefix.host = prefix.backup.host_indices
        return prefix.device, None, "computed", time.perf_counter() - t0

    async def serve(
        self, rid: int, prefix: Prefix, prompt: torch.Tensor, logits_out: list[torch.Tensor]
    ) -> RequestReport:
        """Prefill ``prompt`` after ``prefix`` and generate ``new_tokens`` greedily."""
        opt = self.opt
        self.clock += 1
        prefix.users += 1  # not evictable while in use
        prefix.last_used = self.clock
        own: torch.Tensor | None = None
        try:
            pages, load, source, before_s = await self.prefix_pages(prefix)
            own = await self.allocate(math.ceil((prompt.numel() + opt.new_tokens) / opt.page_size) * opt.page_size)
            table = torch.cat([pages, own])
            start = prefix.tokens.numel()
            try:
                logits, waited = await self.forward(prompt, start, table, load)
                load_ms = 0.0 if load is None else (await load).seconds_total * 1e3
            except KvtierError:
                if load is not None:  # kvtier freed the pages it had taken: recompute next time
                    prefix.device = None
                raise
            generated: list[int] = []
            pos = start + prompt.numel()
            while True:
                logits_out.append(logits)
                token = logits.argmax(-1)
                generated.append(int(token))
                if len(generated) == opt.new_tokens:
                    break
                logits, _ = await self.forward(token, pos, table, None)
                pos += 1
        finally:
            prefix.users -= 1
            if own is not None:
                self.alloc.free(own)
        exposed = (before_s + waited) * 1e3 if source == "host" else 0.0
        recompute = prefix.recompute_s * 1e3
        from_host = prefix.tokens.numel() if source == "host" else 0
        return RequestReport(
            rid, prefix.name, source, from_host, load_ms, exposed, recompute,
            recompute - exposed if source == "host" else 0.0, generated,
        )

    async def close(self) -> None:
        """Give every slot back (write-through backups finish first)."""
        assert self.sched is not None
        for p in self.prefixes.values():
            if p.backup is not None:
                await p.backup
            if p.device is not None:
                self.alloc.free(p.device)
                p.device = None
            if p.host is not None:
                self.sched.free_host(p.host)
                p.host = None


@dataclass
class EngineRun:
    reports: list[RequestReport]
    logits: list[torch.Tensor]  # before every generated token, request after request
    evictions: int
    backups: int
    loads: int
    megabytes_moved: float


async def run_engine(opt: Options, *, offload: bool, device_pages: int) -> EngineRun:
    """Serve ``opt.requests`` requests, alternating between the shared prefixes."""
    model = TinyTransformer(opt)
    engine = PagedEngine(model, opt, device_pages, offload=offload)
    g = torch.Generator().manual_seed(opt.seed + 1)
    names = [chr(ord("A") + i) for i in range(opt.prefixes)]
    for name in names:
        engine.prefixes[name] = Prefix(name, torch.randint(0, opt.vocab, (opt.prefix_tokens,), generator=g))
    prompts = [torch.randint(0, opt.vocab, (opt.suffix_tokens,), generator=g) for _ in range(opt.requests)]
    reports: list[RequestReport] = []
    logits: list[torch.Tensor] = []
    async with TransferScheduler(engine.group, reclaim=engine.reclaim) as sched:
        engine.sched = sched
        for rid in range(opt.requests):
            prefix = engine.prefixes[names[rid % opt.prefixes]]
            reports.append(await engine.serve(rid, prefix, prompts[rid], logits))
        await engine.close()
        s = sched.statistics()
    if s.pools["kv"].used_slots or engine.alloc.num_used_slots:
        raise RuntimeError(
            f"slots leaked: {s.pools['kv'].used_slots} host, {engine.alloc.num_used_slots} device"
        )
    return EngineRun(
        reports, logits, engine.evictions, s.backup.completed, s.load.completed,
        (s.backup.bytes + s.load.bytes) / 1e6,
    )


@dataclass
class Summary:
    requests: int
    host_hits: int
    tokens_reused_from_host: int
    load_ms: float
    exposed_ms: float
    saved_ms: float
    evictions: int
    backups: int
    loads: int
    megabytes_moved: float
    seconds: float
    identical_outputs: bool
    reports: list[dict[str, object]]


async def run(opt: Options) -> Summary:
    """The tiered run and a never-evicting reference run, compared."""
    # One compute thread: the engine computes on one core while kvtier copies on
    # the other; and multi-threaded CPU matmuls are not reproducible bit for bit
    # from run to run, which the comparison below needs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        prefix_pages = opt.prefix_tokens // opt.page_size
        own_pages = math.ceil((opt.suffix_tokens + opt.new_tokens) / opt.page_size)
        # Reference: room for every prefix, so nothing is ever evicted.
        ref = await run_engine(opt, offload=False, device_pages=opt.prefixes * prefix_pages + own_pages)
        # Tiered: room for one prefix and one request, so each prefix evicts the other.
        got = await run_engine(opt, offload=True, device_pages=prefix_pages + own_pages)
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    identical = (
        ref.evictions == 0
        and [r.generated for r in got.reports] == [r.generated for r in ref.reports]
        and len(got.logits) == len(ref.logits)
        and all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))
    )
    hits = [r for r in got.reports if r.source == "host"]
    return Summary(
        requests=len(got.reports),
        host_hits=len(hits),
        tokens_reused_from_host=sum(r.tokens_from_host for r in hits),
        load_ms=sum(r.load_ms for r in hits),
        exposed_ms=sum(r.exposed_ms for r in hits),
        saved_ms=sum(r.saved_ms for r in hits),
        evictions=got.evictions,
        backups=got.backups,
        loads=got.loads,
        megabytes_moved=got.megabytes_moved,
        seconds=seconds,
        identical_outputs=identical,
        reports=[asdict(r) for r in got.reports],
    )


def parse_args(argv: Sequence[str] | None) -> tuple[Options, bool]:
    d = Options()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens, help="tokens per shared prefix")
    ap.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens, help="each request's own prompt")
    ap.add_argument("--new-tokens", type=int, default=d.new_tokens, help="tokens generated per request")
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--corrupt", action="store_true",
                    help="alter one page of a prefix on the host after its backup (the check must then fail)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    for name in ("prefix_tokens", "suffix_tokens", "new_tokens", "requests", "layers", "page_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    if a.prefix_tokens % a.page_size:
        ap.error(f"--prefix-tokens must be a whole number of pages of {a.page_size}; got {a.prefix_tokens}")
    if a.hidden % d.heads:
        ap.error(f"--hidden must be a multiple of {d.heads} heads; got {a.hidden}")
    opt = Options(
        prefix_tokens=a.prefix_tokens, suffix_tokens=a.suffix_tokens, new_tokens=a.new_tokens,
        requests=a.requests, layers=a.layers, hidden=a.hidden, page_size=a.page_size, seed=a.seed,
        corrupt=a.corrupt,
    )
    return opt, a.json


def main(argv: Sequence[str] | None = None) -> int:
    opt, as_json = parse_args(argv)
    summary = anyio.run(run, opt)
    if as_json:
        print(json.dumps(asdict(summary), indent=2))
        return 0 if summary.identical_outputs else 1
    print(
        f"paged_engine: {opt.requests} requests over {opt.prefixes} shared prefixes of {opt.prefix_tokens} tokens "
        f"({opt.layers} layers, page size {opt.page_size}); the device pool holds one prefix at a time"
    )
    for r in summary.reports:
        line = f"  request {r['request']} (prefix {r['prefix']}): "
        if r["source"] == "host":
            line += (
                f"{r['tokens_from_host']} tokens reused from the host tier | load {r['load_ms']:.1f} ms, "
                f"{r['exposed_ms']:.1f} ms of it on the critical path | recompute {r['recompute_ms']:.1f} ms | "
                f"saved {r['saved_ms']:.1f} ms"
            )
        elif r["source"] == "device":
            line += "prefix reused from the device"
        else:
            line += f"prefix computed ({r['recompute_ms']:.1f} ms) and backed up to the host"
        print(line)
    print(f"  host hits             {summary.host_hits} requests, {summary.tokens_reused_from_host} prefix tokens "
          f"reused from the host tier")
    print(f"  time saved            {summary.saved_ms:.1f} ms against recomputing those prefixes "
          f"(loads took {summary.load_ms:.1f} ms, {summary.exposed_ms:.1f} ms of it on the critical path)")
    print(f"  kvtier                {summary.backups} backups, {summary.loads} loads, "
          f"{summary.megabytes_moved:.1f} MB moved, {summary.evictions} evictions")
    verdict = "identical" if summary.identical_outputs else "DIFFERENT"
    print(f"  outputs               {verdict} to the never-evicting run "
          f"(every token and logit, torch.equal) in {summary.seconds:.1f} s")
    return 0 if summary.identical_outputs else 1


if __name__ == "__main__":
    sys.exit(main())
