"""Drop entries keyed by the Plan repr from before stat_chunk/stat_chunks (unreachable since)."""

import json
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    before = len(d["entries"])
    d["entries"] = {k: v for k, v in d["entries"].items() if not ("Plan(" in k and "stat_chunks=" not in k)}
    json.dump(d, open(path, "w"), indent=1, sort_keys=True)
    open(path, "a").write("\n")
    print(path, before, "->", len(d["entries"]))
