# Sourced by the GPU machine's scripts (bench/gpu.sh, bench/multi_gpu.sh): installs, offline, the wheels
# the GPU image lacks (carried in ./.whl, see ../shared/gpu/wheels.sh) and sd-kernels itself.
export PYTHONUNBUFFERED=1
if ! python3 -c "import diffusers" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    || { echo "$0: could not install the carried wheels in .whl" >&2; exit 1; }
  export PYTHONPATH=$PWD/.site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || { echo "$0: could not install sd-kernels" >&2; exit 1; }
