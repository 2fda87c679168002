# Session 15, call 6 (H200): tuning tables for the changed GroupNorm kernels; then the fidelity GPU tests (SD1.5 eager and
# graphed, SD2.1, SDXL patched vs stock), the GroupNorm patch's and the precompile's GPU tests, on the H200's new tables.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 300 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -s tests/test_fidelity.py tests/patches/test_group_norm_patch.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_precompile.py > $R/gpu-precompile.txt 2>&1; echo "rc $?" >> $R/gpu-precompile.txt
cd $OUT && tar czf r.tgz r && rm -rf r
