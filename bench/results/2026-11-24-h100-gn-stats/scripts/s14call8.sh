# Session 14, call 8 (H100): fidelity of SD1.5/SD2.1/SDXL patched vs stock (fp16, 20 steps) and the GroupNorm patch GPU tests
# after the statistics change; SD2.1 768² end to end (peer, patch(pipe), ours best) in one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -s tests/test_fidelity.py tests/patches/test_group_norm_patch.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 340 python3 -m bench.e2e --out $R/e2e --models sd21@768 --variants stock+compile-graphs,patched+graph,patched+graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
