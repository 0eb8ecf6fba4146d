import os

import pytest

from tests.helpers import memfd_holders, poll_until


@pytest.fixture(autouse=True)
def no_buffer_outlives_its_test():
    """After every test, no process but this one holds a modelwarden buffer descriptor: the
    daemon let go of every client's buffers, and no client leaked one (as Triton checks
    /dev/shm)."""
    yield
    poll_until(lambda: not memfd_holders(exclude=(os.getpid(),)), timeout=15,
               message=f"no other process holding a memfd:modelwarden ({memfd_holders((os.getpid(),))})")
