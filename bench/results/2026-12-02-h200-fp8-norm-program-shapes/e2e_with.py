"""bench.fp8 with layer_norm.QUANT_BLOCKS["narrow"] set from the probe's choice (argv[1]: its JSON)."""
import ast
import json
import runpy
import sys

from sd_kernels.ops import layer_norm as ln

choice = ast.literal_eval(json.load(open(sys.argv[1]))["narrow_choice"])
ln.QUANT_BLOCKS["narrow"] = tuple(choice)
print("QUANT_BLOCKS", ln.QUANT_BLOCKS, flush=True)
sys.argv = ["bench.fp8", *sys.argv[2:]]
runpy.run_module("bench.fp8", run_name="__main__")
