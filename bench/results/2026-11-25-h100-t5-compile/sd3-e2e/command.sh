# Session 21, call D: SD3-medium 1024² end to end with both peer rows and ours (its T5 compiled under
# compile=True), in one process (call C's run of this ran out of time before our row).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 575 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium --variants stock,patched+graph+compile,stock+compile-graphs,stock+compile-graphs-unfused-qkv > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cut -c1-400 $R/bench-dit-sd3.txt
cd $OUT && tar czf r.tgz r && rm -rf r
