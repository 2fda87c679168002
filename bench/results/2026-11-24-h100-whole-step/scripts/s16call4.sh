# Session 16, call 4 (H100): whole-step graphs with state tensors rebound by copy (no recapture when a call follows
# another chain): GPU tests; timelines of one SD1.5 call, pipeline graphs vs whole-step graphs (no compile); SD1.5 end
# to end, ours best with pipeline graphs vs with whole-step graphs, one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider -rs tests/patches/test_whole_step.py > $R/gpu-whole-step.txt 2>&1; echo "rc $?" >> $R/gpu-whole-step.txt
for v in patched+graph patched+step-graph; do
  timeout 100 python3 -m bench.timeline --out $R/timeline --variant $v > $R/timeline-$v.log 2>&1; echo "rc $?" >> $R/timeline-$v.log
done
timeout 220 python3 -m bench.e2e --out $R/e2e --models sd15@512 --variants patched+graph+compile+fused-qkv,patched+step-graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
