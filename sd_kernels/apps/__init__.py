"""The applications on top of everything: the ``sd-kernels`` command line (``cli``) and image generation
to a folder, one GPU or several (``generate``)."""
