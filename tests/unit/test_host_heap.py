"""distrib.launch.allocator and distrib.distributed.host_heap: the launcher preloads tcmalloc for its CPU workers where
it is installed, unless the user chose otherwise; on glibc a CPU worker keeps the memory a step frees, unless the
environment tunes malloc."""

import platform
import resource

import pytest
import torch

from distrib.distributed.host_heap import keep_freed_memory, return_freed_memory
from distrib.errors import UserError
from distrib.launch import allocator


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
    # glibc's own thresholds: 16,400 (all but the 64 MiB it keeps) every time; the best of three steps, since one of
    # them may still meet the heap settling (once, in a full unit lane: 1,536)
    assert min(_faults_of_a_step(128) for _ in range(3)) < pages // 100


def test_malloc_tuning_in_the_environment_is_left_as_the_user_set_it():
    assert not keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})


def test_the_launcher_preloads_tcmalloc_for_cpu_workers_where_it_is_installed(tmp_path, monkeypatch):
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    monkeypatch.setitem(allocator.LIBRARIES, "tcmalloc", (str(library), "tcmalloc_minimal"))
    assert allocator.worker_preload({}, num_gpus=0) == {"LD_PRELOAD": str(library)}
    assert allocator.worker_preload({}, num_gpus=2) == {}  # GPU workers' large tensors live on the device
    # the user's choice stands: glibc, a library of their own, glibc tuned by hand
    for environ in ({"DISTRIB_HOST_ALLOCATOR": "glibc"}, {"LD_PRELOAD": "/opt/libmine.so"},
                    {"MALLOC_MMAP_THRESHOLD_": "65536"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}):
        assert allocator.worker_preload(environ, num_gpus=0) == {}, environ
    with pytest.raises(UserError, match="DISTRIB_HOST_ALLOCATOR='tcmallo': .* tcmalloc, jemalloc or glibc"):
        allocator.worker_preload({"DISTRIB_HOST_ALLOCATOR": "tcmallo"}, num_gpus=0)


def test_without_tcmalloc_the_workers_keep_glibc_with_distribs_thresholds_and_the_log_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(allocator.LIBRARIES, "tcmalloc", (str(tmp_path / "absent.so"), "no_such_allocator_here"))
    assert allocator.worker_preload({}, num_gpus=0) == {}
    assert "apt-get install libtcmalloc-minimal4" in allocator.running({})
    assert allocator.running({"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4"}).startswith("tcmalloc")
    # under a preloaded allocator glibc's thresholds would mean nothing: they are not set
    assert not keep_freed_memory({"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4"})
    assert not return_freed_memory({"LD_PRELOAD": "/x/libjemalloc.so.2"})
