# Session 21, call C: text encoders eager vs compiled in their graphs (T5 at 64/300 tokens, CLIP-L/G at 77),
# then SD3-medium 1024² end to end with both peer rows (its T5 now compiled under compile=True), in one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 200 python3 scratch/textenc.py $R > $R/textenc.txt 2>&1; echo "rc $?" >> $R/textenc.txt
grep -v Warn $R/textenc.txt | tail -6
timeout 380 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium --variants stock,stock+compile-graphs,stock+compile-graphs-unfused-qkv,patched+graph+compile > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cut -c1-400 $R/bench-dit-sd3.txt
cd $OUT && tar czf r.tgz r && rm -rf r
