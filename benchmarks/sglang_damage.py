"""The damaged-page case and the cost of sealing, kvtier's backend against SGLang's built-in file backend.

Run in the SGLang venv (``make test-sglang`` builds it)::

    .venv-sglang/bin/python benchmarks/sglang_damage.py [--pages 64] [--damaged 8]

Both backends store the same pages of one SGLang host pool (MHA, page_first,
bf16, 8 layers x 8 KV heads x 128 dims, 16 tokens a page: 512 KiB a page) in
a local directory. Then one bit is flipped in the stored bytes of
``--damaged`` pages (the same pages for both) and every page is read back
into another host pool, as SGLang's prefetch does: a page SGLang reads as a
hit but whose bytes differ is *wrong*; SGLang uses the leading run of hits
(``prefix``). Timings are medians of five writes and reads of the undamaged
pages, as a ratio to HiCacheFile in the same run (the machine may be loaded).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(ROOT / "tests" / "sglang" / "stand_ins"))  # see its docstring

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 16, 8, 8, 128


def host_pool(pages: int) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(pages * PAGE, PAGE, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, "page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                                start_layer=0, end_layer=LAYERS)


def config(extra: dict[str, object]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench", extra_config=extra)


def page(host: MHATokenToKVPoolHost, start: int) -> torch.Tensor:
    return host.get_data_page(start, flat=True).contiguous().view(torch.uint8)


def flip_one_bit(path: Path, rng: random.Random) -> None:
    raw = bytearray(path.read_bytes())
    raw[rng.randrange(len(raw) // 2, len(raw))] ^= 1 << rng.randrange(8)  # in the page bytes, past any header
    path.write_bytes(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--damaged", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    src, dst = host_pool(args.pages), host_pool(args.pages)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=torch.Generator().manual_seed(args.seed)).to(torch.bfloat16))
    starts = [i * PAGE for i in range(args.pages)]
    keys = list(get_storage_hash_str(list(range(args.pages * PAGE)), None, page_size=PAGE))
    indices = torch.arange(args.pages * PAGE)
    damaged = sorted(rng.sample(range(args.pages), args.damaged))
    root = Path(tempfile.mkdtemp(prefix="kvtier-sglang-bench-"))
    try:
        builtin = HiCacheFile(config({"file_storage_path": str(root / "builtin")}))
        kvtier = KvtierHiCacheStorage(config({"store_path": str(root / "kvtier")}))
        kvtier.register_mem_pool_host(dst)

        def builtin_set() -> None:
            builtin.clear()
            assert builtin.batch_set(keys, [src.get_data_page(s, flat=True) for s in starts])

        def builtin_get() -> list[bool]:
            out = []
            for k, s in zip(keys, starts):
                got = builtin.get(k, dst.get_dummy_flat_data_page())
                if got is not None:
                    dst.set_from_flat_data_page(s, got)
                out.append(got is not None)
            return out

        kv_writer = KvtierHiCacheStorage(config({"store_path": str(root / "kvtier")}))
        kv_writer.register_mem_pool_host(src)

        def kvtier_set() -> None:
            assert all(kv_writer.batch_set_v1(keys, indices))

        def kvtier_get() -> list[bool]:
            return kvtier.batch_get_v1(keys, indices)

        timing: dict[str, float] = {}
        for name, fn in (("builtin set", builtin_set), ("builtin get", builtin_get),
                         ("kvtier set", kvtier_set), ("kvtier get", kvtier_get)):
            runs = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t)
            timing[name] = statistics.median(runs)

        assert kvtier.namespace is not None
        for i in damaged:
            flip_one_bit(root / "builtin" / f"{keys[i]}{builtin.config_suffix}.bin", rng)
            kv_key = kvtier.namespace.key(keys[i]).hex()
            flip_one_bit(root / "kvtier" / kvtier.namespace.label() / kv_key[:2] / f"{kv_key}.data", rng)
        gb = args.pages * src.get_size_per_token() * PAGE / 1e9
        print(f"{args.pages} pages of {src.get_size_per_token() * PAGE >> 10} KiB, one bit flipped in pages {damaged}")
        for name, get in (("SGLang HiCacheFile", builtin_get), ("kvtier file store", kvtier_get)):
            dst.kv_buffer.zero_()
            hits = get()
            wrong = sum(h and not torch.equal(page(dst, s), page(src, s)) for h, s in zip(hits, starts))
            prefix = hits.index(False) if False in hits else len(hits)
            wrong_in_prefix = sum(not torch.equal(page(dst, s), page(src, s)) for s in starts[:prefix])
            print(f"  {name:20s} hits {sum(hits):3d}/{args.pages}  wrong pages returned as hits {wrong:2d}  "
                  f"prefix SGLang uses {prefix:3d} pages, {wrong_in_prefix} of them wrong")
        for op in ("set", "get"):
            b, k = timing[f"builtin {op}"], timing[f"kvtier {op}"]
            print(f"  {op}: HiCacheFile {gb / b:5.2f} GB/s, kvtier {gb / k:5.2f} GB/s ({b / k:.2f}x of HiCacheFile)")
        print(f"  kvtier counters: {kvtier.statistics()}")
        kvtier.close()
        kv_writer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
