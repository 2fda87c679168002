# Session 24 call 3: the final pack8 kernels (after the _tile/_at refactor) compiled, tested, timed
R=$OUT/r3; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>/dev/null
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_pack8.py -p no:cacheprovider > $R/tests-pack8.txt 2>&1; tail -2 $R/tests-pack8.txt
timeout 150 python3 -m pytest -q -m gpu tests/test_memory.py -k "streamed and mobile" -p no:cacheprovider > $R/tests-stream.txt 2>&1; tail -2 $R/tests-stream.txt
timeout 120 python3 -m bench.run --only pack8 --out $R/ops > $R/ops.txt 2>&1; grep "<-" $R/ops.txt | grep ours | cut -c1-200
timeout 150 python3 -m bench.stream_decode --out $R/stream --graph --profiles mobile-small --repeats 5 > $R/stream.txt 2>&1; grep -E "CUDA graph|untiled" $R/stream.txt | head -8 | cut -c1-160
tar -C $R -czf $OUT/r3.tgz . 
