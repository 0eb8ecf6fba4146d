import pytest

from tests.helpers import our_segments, poll_until


@pytest.fixture(autouse=True)
def shm_back_to_baseline():
    """Every test leaves /dev/shm as it found it (no segment of ours leaks), as Triton checks."""
    before = our_segments()
    yield
    poll_until(lambda: our_segments() <= before, timeout=15,
               message=f"/dev/shm back to its baseline (extra: {our_segments() - before})")
