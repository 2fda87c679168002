#!/usr/bin/env bash
# The one command for the GPU machine: install offline, run the GPU tests, the per-op benchmarks, the
# end-to-end benchmarks with the paper's ablation and the SD1.5 demo, write everything to OUT_DIR
# (CSV, pytest-benchmark JSON, PNG plots), print the end-to-end table last.
#   bash bench/gpu.sh OUT_DIR [bench.run options, e.g. --quick --only group_norm,attention]
# Needs ./.whl with the wheels the GPU image lacks (../shared/gpu/wheels.sh), carried along.
# GPU_STEPS (default "tests,bench,e2e,demo") picks steps, to split the work over several calls (one
# call may run 10 minutes: "e2e" alone takes them, see docs/benchmarks.md);
# GPU_TEST_FILES picks test files (default: every file with gpu-marked tests); GPU_TEST_ALL=1 runs every
# test of those files (default files: all of tests/), the tiny-shape tests that take the `device` fixture
# included: they run compiled on the GPU only so (long: pick files);
# E2E_ARGS: bench.e2e options (default "--selection quick --max-minutes 8").
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUT_DIR [--quick] [--only FAMILIES]}
shift
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
  python3 -m sd_kernels info; } 2>&1 | tee "$out/gpu.txt"

steps=",${GPU_STEPS:-tests,bench,e2e,demo},"
tests_rc=0 bench_rc=0 e2e_rc=0 demo_rc=0
if [[ $steps == *,tests,* ]]; then
  # One process per test file: a kernel fault poisons its CUDA context, and must not hide the rest.
  : > "$out/gpu-tests.log"
  if [[ ${GPU_TEST_ALL:-0} == 1 ]]; then
    marker=() default_files=$(find tests -name 'test_*.py' | sort)
  else
    marker=(-m gpu) default_files=$(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
  fi
  for f in ${GPU_TEST_FILES:-$default_files}; do
    python3 -m pytest "${marker[@]}" -q -rf -p no:cacheprovider "$f" > /tmp/gpu-test.log 2>&1
    rc=$?
    (( rc == 5 )) && rc=0  # no gpu test selected in that file
    tests_rc=$(( tests_rc || rc ))
    cat /tmp/gpu-test.log >> "$out/gpu-tests.log"
    echo "$f: $(tail -n 1 /tmp/gpu-test.log)" | tee -a "$out/gpu.txt"
  done
fi
if [[ $steps == *,bench,* ]]; then
  python3 -m bench.run --out "$out" "$@" 2>&1 | tee "$out/bench.log"
  bench_rc=${PIPESTATUS[0]}
  # The same op cases through pytest-benchmark (eager wall times, host included) for its JSON.
  python3 -m pytest -q -p no:cacheprovider bench/test_ops_benchmark.py --benchmark-enable \
    --benchmark-json "$out/ops-benchmark.json" > "$out/ops-benchmark.log" 2>&1 \
    || echo "gpu.sh: pytest-benchmark run failed, see ops-benchmark.log" >&2
fi
if [[ $steps == *,e2e,* ]]; then
  # tqdm's bar goes to stderr, kept out of the log; the rows and the table go to stdout.
  python3 -m bench.e2e --out "$out" ${E2E_ARGS:---selection quick --max-minutes 8} | tee "$out/e2e.log"
  e2e_rc=${PIPESTATUS[0]}
fi
python3 -m bench.plot "$out" > /dev/null 2>&1 || echo "gpu.sh: no plots (nothing measured?)" >&2
if [[ $steps == *,demo,* ]]; then
  python3 -m sd_kernels demo --steps 20 --out /tmp/sd-kernels-demo.png 2>&1 | grep -v 'it/s]' | tee "$out/demo.log"
  demo_rc=${PIPESTATUS[0]}
fi

echo
[ -f "$out/gpu-tests.log" ] && { echo "== GPU tests:"; grep "^tests/.*: " "$out/gpu.txt"; }
[ -f "$out/demo.log" ] && echo "== demo:       $(grep -E '^(stock|patched)' "$out/demo.log" | tr '\n' ' ')"
echo "== benchmarks (ours vs stock; ms = device time from a CUDA graph, eager = one call at a time):"
[ -f "$out/ops.csv" ] && python3 - "$out/ops.csv" <<'PY'
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except FileNotFoundError:
    sys.exit("no ops.csv")
for r in rows:
    if r["impl"] != "stock":
        print(f'{r["op"]:<24} {r["shape"]:<22} {r["variant"]:<10} {r["impl"]:<14} {float(r["ms"]):8.4f} ms '
              f'{float(r["speedup_vs_stock"]):6.2f}x  {r["pct_copy_bw"]:>6}% bw  {r["TFLOP/s"]:>7} TF/s  '
              f'eager {float(r["eager_ms"]):8.4f} ms {float(r["eager_speedup"]):5.2f}x')
PY
# Last, the end-to-end summary bench.e2e printed: ablation, the table, the H100 goals.
[ -f "$out/e2e.log" ] && sed -n '/^== ablation\|^== end to end/,$p' "$out/e2e.log"
ls "$out"/*.png 2>/dev/null
exit $(( tests_rc || bench_rc || e2e_rc || demo_rc ))
