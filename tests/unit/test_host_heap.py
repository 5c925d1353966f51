"""distrib.distributed.host_heap: a CPU worker keeps the memory a step frees, unless the environment tunes malloc."""

import platform
import resource

import pytest
import torch

from distrib.distributed.host_heap import keep_freed_memory


def _faults_of_a_step(num_mib: int) -> int:
    """Minor page faults of this thread while it allocates and writes num_mib tensors of 1 MiB, then frees them in
    the order they were made (as a step frees its activations): the heap's top is freed last, all at once."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    tensors = [torch.ones(1 << 18) for _ in range(num_mib)]  # 1 MiB of fp32 each, every page written
    while tensors:
        tensors.pop(0)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_step_that_frees_more_than_glibc_keeps_faults_no_pages_the_next_time():
    assert keep_freed_memory({})
    _faults_of_a_step(128)  # the first step grows the heap (128 MiB: above the 64 MiB glibc would keep by itself)
    pages = 128 * (1 << 20) // resource.getpagesize()
    assert _faults_of_a_step(128) < pages // 100  # glibc's own thresholds: 16,400 (all but the 64 MiB it keeps)


def test_malloc_tuning_in_the_environment_is_left_as_the_user_set_it():
    assert not keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
