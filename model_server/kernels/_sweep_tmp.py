import itertools
import time

import torch
from triton.testing import do_bench

from model_server.kernels.bench import Case, Shape, _build
from model_server.kernels.paged_decode import paged_decode_attention
from model_server.kernels.paged_prefill import paged_prefill_attention

dev = torch.device("cuda")
shape = Shape(32, 8, 128, 16, torch.bfloat16)
scale = 128**-0.5


def dec(case, splits_list):
    md, q, k, v, kc, vc = _build(case, shape, dev)
    out = torch.empty_like(q)
    nd = md.num_decodes
    ml = max(md.seq_lens_cpu)
    byt = sum(md.seq_lens_cpu) * 8 * 128 * 4
    res = []
    for ns, tile, w, st in itertools.product(splits_list, (32, 64, 128), (4, 8), (2, 3, 4)):
        def f():
            paged_decode_attention(out[:nd], q[:nd], kc, vc, md.seq_lens, md.block_tables, scale, ml, ns, tile_n=tile, num_warps=w, num_stages=st)
        try:
            t = do_bench(f, warmup=10, rep=40)
        except Exception as e:
            print("fail", ns, tile, w, st, type(e).__name__)
            continue
        res.append((t, ns, tile, w, st))
    res.sort()
    print(case.name, "best:")
    for t, ns, tile, w, st in res[:6]:
        print(f"   {t*1e3:7.1f} us {byt/t/1e6:7.0f} GB/s splits {ns} tile {tile} warps {w} stages {st}")
    d = [r for r in res if r[2:] == (64, 4, 3)]
    for r in d:
        print(f"   default-ish splits {r[1]}: {r[0]*1e3:7.1f} us")
    # host launch cost
    f = lambda: paged_decode_attention(out[:nd], q[:nd], kc, vc, md.seq_lens, md.block_tables, scale, ml, splits_list[-1])
    f(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        f()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"   host launch cost {(t1-t0)/200*1e6:.1f} us/call (splits {splits_list[-1]})")


def pre(case):
    md, q, k, v, kc, vc = _build(case, shape, dev)
    out = torch.empty_like(q)
    res = []
    fl = 0
    for c, n in case.requests:
        fl += 4 * (n * c + n * (n + 1) // 2) * 32 * 128
    for bm, tile, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        def f():
            paged_prefill_attention(out, q, kc, vc, md.query_start_loc, md.seq_lens, md.block_tables, scale, md.num_decodes, md.num_prefills, md.max_query_len, block_m=bm, tile_n=tile, num_warps=w, num_stages=st)
        try:
            t = do_bench(f, warmup=10, rep=40)
        except Exception as e:
            print("fail", bm, tile, w, st, type(e).__name__)
            continue
        res.append((t, bm, tile, w, st))
    res.sort()
    print(case.name, "best:")
    for t, bm, tile, w, st in res[:6]:
        print(f"   {t*1e3:7.1f} us {fl/t/1e9:6.1f} TFLOP/s block_m {bm} tile {tile} warps {w} stages {st}")
    d = [r for r in res if r[1:] == (128, 64, 8, 3)]
    for r in d:
        print(f"   default-ish: {r[0]*1e3:7.1f} us")


dec(Case("decode b64 ctx1024", [(1024, 1)] * 64), [1, 2])
dec(Case("decode b16 ctx1024", [(1024, 1)] * 16), [1, 2, 4, 8])
dec(Case("decode b4 ctx16384", [(16384, 1)] * 4), [8, 16, 32])
dec(Case("decode b1 ctx4096", [(4096, 1)]), [4, 8, 16, 32])
pre(Case("prefill 4x2048", [(0, 2048)] * 4))
pre(Case("chunk 512 after 1536 x4", [(1536, 512)] * 4))
pre(Case("prefill 1x512", [(0, 512)]))
