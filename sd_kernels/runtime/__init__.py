"""The launch floor, under the kernels: which path an op takes (``dispatch``), how an autotuned kernel is
launched with little host time (``launch``, ``direct_launch``), where its tuned choices persist
(``autotune_cache``), how a call's kernels compile ahead in parallel (``precompile``), and device
memory budgets (``memory``). Nothing here imports the kernels or the diffusers patch
(tests/test_layering.py); docs/design.md draws the floors."""
