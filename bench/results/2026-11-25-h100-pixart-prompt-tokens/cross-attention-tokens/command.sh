mkdir -p $OUT/r
timeout 400 python3 scratch/xattn.py $OUT/r > $OUT/r/xattn.txt 2>&1
tail -30 $OUT/r/xattn.txt
cd $OUT && tar czf r.tgz r && rm -rf r
