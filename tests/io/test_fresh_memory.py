import sys

import numpy as np
import pytest

from tests.support.smaps import mapping_field
from tiered_ckpt.io.fresh_memory import MAPPED_BYTES, new_array

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the advice and /proc/self/smaps are Linux's")


def vm_flags(array: np.ndarray) -> set[str]:
    """The VmFlags of the mapping that holds ``array``'s middle byte (numpy advises from the
    first page boundary on, which splits the mapping there)."""
    return set(mapping_field(array.__array_interface__["data"][0] + array.nbytes // 2, "VmFlags:"))


@pytest.mark.parametrize(
    "shape,dtype", [((3, MAPPED_BYTES // 4), np.float32), ((MAPPED_BYTES + 3,), np.uint8), ((5,), np.int64)]
)
def test_a_new_array_is_writable_contiguous_and_of_its_shape(shape, dtype):
    array = new_array(shape, dtype)
    assert array.shape == shape and array.dtype == dtype
    assert array.flags.c_contiguous and array.flags.writeable
    array[...] = 7
    assert (array == 7).all()


@linux
def test_a_large_new_array_is_page_aligned_and_never_advised_to_use_huge_pages():
    array = new_array((MAPPED_BYTES // 8,), np.float64)
    assert array.__array_interface__["data"][0] % 4096 == 0
    assert "hg" not in vm_flags(array)


@linux
def test_numpy_advises_huge_pages_for_the_same_size_which_is_why_new_array_exists():
    array = np.empty(MAPPED_BYTES // 8, np.float64)
    if "hg" not in vm_flags(array):
        pytest.skip("this numpy or kernel gives no huge-page advice")
    assert "hg" in vm_flags(array)
