#!/usr/bin/env bash
# The multi-GPU host's command: one image on several GPUs (bench.parallel: each model on one GPU first,
# the reference, then on W GPUs) and batch throughput on one GPU and on all of them (bench.throughput
# under accelerate). Everything goes to OUT_DIR; the tables are printed last.
#   bash bench/multi_gpu.sh OUT_DIR
# PAR_MODELS   models, in order (default "flux-dev,sdxl,sd3-medium,pixart-sigma"; "" for none);
# PAR_WORLDS   GPU counts above one (default: 2, and 4 where the host has 4);
# PAR_ONE_GPU  the one-GPU variants (default "stock,ours": the reference image and our time);
# PAR_MULTI    the variants on W GPUs (default: every one bench.parallel plans, FLUX's ring ones in a launch of
#              their own);
# PAR_ARGS     more bench.parallel options (e.g. "--calls 2");
# THROUGHPUT   1 (default) or 0.
# Needs ./.whl carried along (../shared/gpu/wheels.sh).
set -uo pipefail
out=${1:?usage: bench/multi_gpu.sh OUT_DIR}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"

gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$out/gpu.txt"
worlds=${PAR_WORLDS:-$( (( gpus >= 4 )) && echo "2 4" || echo 2)}
rc=0
if [[ ${THROUGHPUT:-1} == 1 ]]; then
  python3 -m bench.throughput --out "$out" 2>&1 | tee -a "$out/throughput.log"
  rc=$(( rc || PIPESTATUS[0] ))
  python3 -m accelerate.commands.launch --multi_gpu --num_processes "$gpus" -m bench.throughput --out "$out" 2>&1 \
    | tee -a "$out/throughput.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
run() {  # run W ARGS...: bench.parallel on W GPUs
  local w=$1; shift
  python3 -m torch.distributed.run --standalone --nproc_per_node "$w" -m bench.parallel --out "$out" "$@" \
    ${PAR_ARGS:-} 2>&1 | tee -a "$out/parallel.log"
  rc=$(( rc || PIPESTATUS[0] ))
}
models=${PAR_MODELS-flux-dev,sdxl,sd3-medium,pixart-sigma}
for model in ${models//,/ }; do
  run 1 --models "$model" --variants "${PAR_ONE_GPU:-stock,ours}"
  for w in $worlds; do
    (( w <= gpus )) && run "$w" --models "$model" ${PAR_MULTI:+--variants "$PAR_MULTI"}
    # the ring exchange in a launch of its own (enable_parallelism cannot be undone): FLUX, by default
    [[ -z ${PAR_MULTI:-} && $model == flux-dev ]] && (( w <= gpus )) \
      && run "$w" --models "$model" --variants ring-peer,ring-ours,ring-ours+graphs,ring-ours+graphs+split-decode,ring-ours+graphs+split-modulation,ring-ours+graphs+split-modulation+split-decode
  done
done

echo
for f in throughput.csv parallel.csv; do
  [ -f "$out/$f" ] && { echo "== $f"; python3 -c "import csv,sys; [print('  '.join(r)[:220]) for r in csv.reader(open(sys.argv[1]))]" "$out/$f"; }
done
exit $rc
