"""The one gate for tests of kvserve's C++ CPU kernels.

A machine without a C++ compiler, or a run with $KVSERVE_DISABLE_CUSTOM_OPS set, skips
them; a build that fails fails them, with the compiler's errors, so that broken kernels
never pass as a missing toolchain.
"""

from __future__ import annotations

import pytest

from kvserve import _custom_ops as ops
from kvserve import kernel_build

_SHOWN_LINES = 40


def require_kernels() -> None:
    """Skip or fail unless the kernels are loaded; call it at a test module's top level
    (after its imports) or at the start of a test."""
    why = ops.why_unavailable()
    if why is None:
        return
    if why.reason is kernel_build.Reason.BUILD_FAILED:
        pytest.fail(
            f"kvserve's C++ kernels failed to build (set ${kernel_build.ENV_DISABLE}=1 to test "
            f"without them):\n{kernel_build.first_errors(why.detail, _SHOWN_LINES)}",
            pytrace=False,
        )
    pytest.skip(
        f"kvserve's C++ kernels: {why.reason.value} ({why.detail})", allow_module_level=True
    )
