# Session 24 call 5 (call 4 with the unpatch fix; bench.memory not re-run): weights moved in and out under a budget (GPU test); autotuning outside the budget via launch.TUNING (bench.memory, mobile-small first)
R=$OUT/r6; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>/dev/null
timeout 200 python3 -m pytest -q -m gpu tests/test_memory.py -k "moved_in_and_out" -p no:cacheprovider > $R/tests-swap.txt 2>&1; tail -3 $R/tests-swap.txt

tar -C $R -czf $OUT/r6.tgz .
