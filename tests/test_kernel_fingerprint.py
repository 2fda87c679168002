"""The fingerprint a tuning table is checked against (sd_kernels.runtime.autotune_cache.kernel_fingerprint):
an edit of what a kernel computes, in its body or in a ``@triton.jit`` helper it calls, changes it; an
edit of its decorators alone (how the JIT specializes integer arguments, how an autotuner's configs are
spelled) does not, so that the shipped tables keep serving the kernel."""

import importlib.util
import itertools
import textwrap

import pytest

from sd_kernels.runtime.launch import Launcher

BASE = dict(
    helper_deco="@triton.jit",
    helper_body="return x * 2.0",
    deco='@triton.autotune([triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=1)], '
         'key=["n"])\n@triton.jit',
    body="tl.store(y_ptr + offs, _helper(tl.load(x_ptr + offs, mask=mask)), mask=mask)",
)
SOURCE = """
import triton
import triton.language as tl


{helper_deco}
def _helper(x):
    {helper_body}


{deco}
def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    {body}
"""
_count = itertools.count()


def _fingerprint(tmp_path, **changes) -> str:
    """The fingerprint of BASE's kernel with ``changes``, from a module of its own (the source is read
    from its file, as for the package's kernels)."""
    name = f"fingerprint_case_{next(_count)}"
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(SOURCE).format(**{**BASE, **changes}))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Launcher(module._kernel).fingerprint


@pytest.mark.parametrize("changes", [
    {"deco": BASE["deco"].replace("@triton.jit", '@triton.jit(do_not_specialize=["n"])')},
    {"deco": BASE["deco"].replace("@triton.jit", "@triton.jit(\n    do_not_specialize=[2],\n)")},
    {"deco": BASE["deco"].replace('key=["n"]', "key=['n'],\n")},  # the same configs and key, spelled otherwise
    {"helper_deco": "@triton.jit(noinline=True)"},
], ids=["do_not_specialize", "a multi-line decorator", "the autotuner's spelling", "a helper's decorator"])
def test_a_decorator_edit_keeps_the_fingerprint(tmp_path, changes):
    assert _fingerprint(tmp_path, **changes) == _fingerprint(tmp_path)


@pytest.mark.parametrize("changes", [
    {"body": BASE["body"].replace("mask=mask)), mask=mask)", "mask=mask)) + 1.0, mask=mask)")},
    {"helper_body": "return x * 3.0"},
    {"deco": BASE["deco"].replace('"BLOCK": 32}, num_warps=1', '"BLOCK": 64}, num_warps=1')},
    {"deco": BASE["deco"].replace('key=["n"]', 'key=["n", "BLOCK"]')},
], ids=["the body", "a called helper's body", "the autotuner's configs", "the autotuner's key"])
def test_an_edit_of_what_the_kernel_computes_or_is_tuned_on_changes_it(tmp_path, changes):
    assert _fingerprint(tmp_path, **changes) != _fingerprint(tmp_path)
