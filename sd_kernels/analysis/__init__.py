"""Reports about kernels and pipelines, above the patch: which kernel a profile picks per shape
(``selection``), the paper's memory table measured (``memory_report``), the phones' latency model
(``latency``), and stock against patched on the same weights (``fidelity``)."""
