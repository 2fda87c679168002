"""The applications on top of everything: the ``sd-kernels`` command line (``cli``; ``generate_command``
for ``generate``) and image generation to a folder, one GPU or several (``generate``, the run; its
parts: ``options``, ``pipeline``, ``metadata``, ``manifest``, ``writer``). docs/generate.md."""
