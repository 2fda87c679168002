set -x
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/r/gpu.txt 2>&1
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $OUT/r/gpu.txt 2>&1
timeout 420 python3 scratch/tma_sweep.py $OUT/r > $OUT/r/sweep.txt 2>&1
tail -40 $OUT/r/sweep.txt
cd $OUT && tar czf r.tgz r && rm -rf r
