# Session 24 call 2: autotuning outside the budget; the whole image under the three mobile profiles (mobile-small first, in a fresh process)
R=$OUT/r2; mkdir -p $R/files
python3 -c "import torch,triton,diffusers,sys;print(torch.__version__,triton.__version__,diffusers.__version__,sys.version)" > $R/files/versions.txt
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv >> $R/files/versions.txt
echo "== bench.memory"; timeout 330 python3 -m bench.memory --out $R/files/mem --profiles mobile-small,s23-ultra,iphone-14-pro-max --steps 20 > $R/files/mem.txt 2>&1; echo rc $?; grep -E "budget|total|within|over" $R/files/mem.txt | cut -c1-220 | tail -30
echo "== GPU memory tests"; timeout 150 python3 -m pytest -q -m gpu tests/test_memory.py tests/test_launch.py -p no:cacheprovider > $R/files/tests-memory.txt 2>&1; tail -3 $R/files/tests-memory.txt
tar -C $R -czf $R/files.tgz files; ls -la $R
