# Session 24 call 7: the final code after the review (TUNING only when tuning; chain-aware swap plan)
R=$OUT/r7; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/test_memory.py -k "moved_in_and_out or streamed" -p no:cacheprovider > $R/tests.txt 2>&1; tail -2 $R/tests.txt
timeout 200 python3 -m bench.memory --out $R/mem --profiles mobile-small --steps 20 > $R/mem.txt 2>&1; echo rc $?; grep -E "total peak|budget exceeded" $R/mem.txt | cut -c1-200
