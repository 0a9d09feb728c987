"""bench.common.prefer_shared_carveout: the hook that sets every loaded kernel's shared-memory carveout (an arm of
bench.engine, `--shared-carveout`). No GPU here: a stand-in for libcuda records the calls."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the triton extra is not installed")

from triton import knobs  # noqa: E402

from g4rt.bench.common import CARVEOUT_ATTRIBUTE, prefer_shared_carveout  # noqa: E402


class FakeCuda:
    def __init__(self, rc=0):
        self.calls, self.rc = [], rc

    def cuFuncSetAttribute(self, function, attribute, value):
        self.calls.append((function.value, attribute, value))
        return self.rc


@pytest.fixture
def hooks():
    before = list(knobs.runtime.kernel_load_end_hook.calls)
    yield knobs.runtime.kernel_load_end_hook
    knobs.runtime.kernel_load_end_hook.calls[:] = before


def test_each_loaded_kernel_gets_the_carveout_and_a_failure_names_it(hooks):
    cuda = FakeCuda()
    prefer_shared_carveout(100, lib=cuda)
    hook = hooks.calls[-1]
    hook(None, None, "_gemv_kernel", {}, "h")  # before the module loads: nothing to set
    hook(object(), 0x1234, "_gemv_kernel", {}, "h")
    assert cuda.calls == [(0x1234, CARVEOUT_ATTRIBUTE, 100)] and CARVEOUT_ATTRIBUTE == 9
    cuda.rc = 1
    with pytest.raises(RuntimeError, match="_copied_gemv_kernel: CUresult 1"):
        hook(object(), 0x99, "_copied_gemv_kernel", {}, "h")


def test_a_carveout_is_a_percentage(hooks):
    with pytest.raises(ValueError, match="0-100, got 101"):
        prefer_shared_carveout(101, lib=FakeCuda())
