# Compile, one at a time for sm_90 on a CPU host, every distinct specialization the GPU compiled in
# before/specs-sd15.jsonl; print per kernel the count, the longest and the median seconds. Run from the
# repository root with Triton 3.6 (the GPU's version) and a fresh TRITON_CACHE_DIR.
import json, ast, time, sys, importlib, collections
sys.path.insert(0, '.')
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
rows=[json.loads(l) for l in open('bench/results/2026-11-28-h200-new-sizes/before/specs-sd15.jsonl')]
mods={'_flash_attention_kernel':'sd_kernels.ops.attention','_group_norm_kernel':'sd_kernels.ops.group_norm','_pixel_norm_kernel':'sd_kernels.ops.group_norm','_pixel_stats_kernel':'sd_kernels.ops.group_norm','_pixel_merge_kernel':'sd_kernels.ops.group_norm','_softmax_matmul_kernel':'sd_kernels.ops.softmax_matmul','_row_stats_kernel':'sd_kernels.ops.softmax_matmul','_linear_geglu_kernel':'sd_kernels.ops.gelu','_elementwise_kernel':'sd_kernels.ops.gelu'}
def find(name):
    m=importlib.import_module(mods[name]); o=getattr(m,name)
    while not isinstance(o, triton.runtime.jit.JITFunction): o=o.fn
    return o
seen=set(); out=collections.defaultdict(list)
for r in rows:
    if r['kernel'] not in mods: continue
    k=(r['kernel'],r['constants'],r['attrs'],json.dumps(r['options']))
    if k in seen: continue
    seen.add(k)
    jit=find(r['kernel'])
    sig=ast.literal_eval(r['signature'])
    cs=r['constants'].replace("torch.","")
    try: consts=eval(r['constants'], {'fp16':tl.float16,'fp32':tl.float32,'bf16':tl.bfloat16,'constexpr':tl.constexpr})
    except Exception as e: print('skip',r['kernel'],e); continue
    attrs=ast.literal_eval(r['attrs'])
    opts={k:v for k,v in r['options'].items() if v is not None}
    t=time.time()
    try: triton.compile(ASTSource(jit, sig, consts, attrs), target=GPUTarget("cuda",90,32), options=opts)
    except Exception as e: print('fail',r['kernel'],type(e).__name__, str(e)[:100]); continue
    out[r['kernel']].append(round(time.time()-t,2))
for k,v in out.items(): print(k, len(v), 'max',max(v),'median',sorted(v)[len(v)//2])
