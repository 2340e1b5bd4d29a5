"""Test setup: every test sees 8 simulated CPU devices so sharded code paths run everywhere."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

# With libtpu installed, the TPU compiler's tests (ahead-of-time compiles) may run in both test processes at once;
# libtpu otherwise refuses a second process through its lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

try:  # property tests are reproducible by default; HYPOTHESIS_PROFILE=explore searches fresh examples
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, database=None)
    _hyp_settings.register_profile("explore", derandomize=False)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test extra; tests that need it importorskip it
    pass


def _has_backend(name: str) -> bool:
    try:
        import jax

        return any(d.platform == name for d in jax.devices(name))
    except Exception:  # no such backend in this jaxlib
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not _has_backend("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "tpu" in item.keywords and not _has_backend("tpu"):
            item.add_marker(pytest.mark.skip(reason="needs a TPU"))
