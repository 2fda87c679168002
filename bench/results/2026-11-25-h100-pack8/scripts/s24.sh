# Session 24 call 1: 8-bit kept activations in the streamed VAE decode (mobile-small)
R=$OUT/r1; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv > $R/gpu.txt
python3 -c "import torch,triton,diffusers,sys;print(torch.__version__,triton.__version__,diffusers.__version__,sys.version)" > $R/versions.txt
date -u > $R/date.txt
echo "== pack8 GPU tests"; timeout 120 python3 -m pytest -q -m gpu tests/ops/test_pack8.py -p no:cacheprovider > $R/tests-pack8.txt 2>&1; tail -2 $R/tests-pack8.txt
echo "== streamed decode GPU tests"; timeout 150 python3 -m pytest -q -m gpu tests/test_memory.py -k "streamed" -p no:cacheprovider > $R/tests-stream.txt 2>&1; tail -2 $R/tests-stream.txt
echo "== bench.stream_decode"; timeout 220 python3 -m bench.stream_decode --out $R/stream --graph > $R/stream.txt 2>&1; tail -12 $R/stream.txt
echo "== bench.run pack8"; timeout 90 python3 -m bench.run --only pack8 --out $R/ops > $R/ops.txt 2>&1; tail -12 $R/ops.txt
echo "== bench.memory mobile-small"; timeout 100 python3 -m bench.memory --out $R/mem --profiles mobile-small --steps 20 > $R/mem.txt 2>&1; tail -15 $R/mem.txt
