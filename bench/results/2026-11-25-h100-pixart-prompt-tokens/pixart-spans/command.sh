# Session 20, call 4: where a PixArt-Σ 1024² call's time goes, the peer's and ours (CUDA-event spans).
set -u
R=$OUT/r; mkdir -p $R
timeout 500 python3 scratch/pixart_spans.py $R patched+graph+compile,stock+compile-graphs-unfused-qkv,patched+graph > $R/spans.txt 2>&1; echo "rc $?" >> $R/spans.txt
grep -v Warning $R/spans.txt | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
