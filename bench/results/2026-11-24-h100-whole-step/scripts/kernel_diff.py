"""Session 16: the same SD1.5 call in the pipeline mode and the whole-step mode, one process: kernel time by name."""
import collections, json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import ProfilerActivity
from bench.e2e import Bench, parse_targets, pipeline_call
from bench.setups import VARIANTS, applied

out = sys.argv[1]
(target,) = parse_targets("sd15@512")
res = {}
with torch.inference_mode():
    bench = Bench(target, 20)
    for variant in ("patched+graph", "patched+step-graph", "patched+graph", "patched+step-graph"):
        with applied(bench.pipe, VARIANTS[variant]):
            call = pipeline_call(bench.pipe, target.size, 20)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            walls = []
            for _ in range(5):
                t0 = time.perf_counter(); call(); torch.cuda.synchronize(); walls.append((time.perf_counter() - t0) * 1e3)
            with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
                call(); torch.cuda.synchronize()
        tot = collections.Counter(); cnt = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot[e.name] += e.time_range.end - e.time_range.start; cnt[e.name] += 1
        res.setdefault(variant, []).append({"walls_ms": [round(w, 2) for w in walls], "busy_ms": sum(tot.values()) / 1e3,
                                            "by_kernel_us": {k: [round(v, 1), cnt[k]] for k, v in tot.most_common()}})
        print(variant, sorted(walls)[2], sum(tot.values()) / 1e3, flush=True)
a, b = res["patched+graph"][-1]["by_kernel_us"], res["patched+step-graph"][-1]["by_kernel_us"]
diff = sorted(((b.get(k, [0, 0])[0] - a.get(k, [0, 0])[0], k, a.get(k), b.get(k)) for k in set(a) | set(b)), reverse=True)
res["largest_differences_us"] = [list(d) for d in diff[:30]]
json.dump(res, open(out, "w"), indent=1)
for d in diff[:15]:
    print(round(d[0], 1), d[1][:90], d[2], d[3])
