"""patches/hooks.py: whether calling a module runs more than its class's forward (what a patch that re-states or
skips the call must step aside for), and what is left behind when hooks are removed."""

import torch
import torch.nn as nn
from diffusers.hooks import HookRegistry, ModelHook
from sd_kernels.patches.hooks import hooked


class _Doubled(ModelHook):
    def post_forward(self, module, output):
        return output * 2


def _restated(self, x):
    return nn.Conv2d.forward(self, x)


def test_hooks_and_their_leftovers():
    conv = nn.Conv2d(2, 2, 3, padding=1)
    assert not hooked(conv)
    handle = conv.register_forward_hook(lambda module, args, out: out)
    assert hooked(conv)
    handle.remove()
    conv.forward = conv.forward  # the class's own, bound: what accelerate's remove_hook_from_module leaves
    assert not hooked(conv)
    conv.forward = lambda x: x
    assert hooked(conv)
    conv.forward = _restated.__get__(conv)  # a patch's own re-statement, bound to the module
    assert hooked(conv) and not hooked(conv, own=(_restated,))
    del conv.forward
    registry = HookRegistry.check_if_exists_or_initialize(conv)
    registry.register_hook(_Doubled(), "doubled")
    assert hooked(conv)
    registry.remove_hook("doubled")
    assert not hooked(conv)  # the registry emptied: nothing runs beside forward
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert hooked(nn.Conv2d(2, 2, 1))
    finally:
        handle.remove()
