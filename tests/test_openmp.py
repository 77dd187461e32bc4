"""The OpenMP pool of a thread that hands its torch work to another (`transformers_jakiro.openmp`): releasing it ends
that thread's workers, and the continuous batching manager releases the pool of the thread that starts it."""

import os
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from tiny_models import trained_pairs
from transformers_jakiro import openmp
from transformers_jakiro.continuous_support import page_allocators_available


def threads_of_this_process() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc (Linux)")
@pytest.mark.skipif(openmp._openmp_runtime() is None, reason="torch has no OpenMP runtime with omp_pause_resource_all")
def test_releasing_a_threads_pool_ends_its_workers():
    """On a thread of its own: parallel work starts a worker thread (its pool), releasing the pool ends that worker,
    and parallel work after that builds the pool again and still computes."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen, big = {}, torch.ones(4_000_000)  # filled here: a fill is parallel work too

    def work():
        alone = threads_of_this_process()
        big.add_(1)  # parallel over 2 threads: this thread's pool gets a worker
        seen["workers"] = threads_of_this_process() - alone
        seen["released"] = openmp.release_thread_pool()
        deadline = time.monotonic() + 5
        while seen["workers"] & threads_of_this_process() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["left"] = seen["workers"] & threads_of_this_process()
        seen["sum"] = float(big.add_(1).sum())  # the pool built again

    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before_threads)
    assert len(seen["workers"]) == 1
    assert seen["released"] is True
    assert not seen["left"]
    assert seen["sum"] == 3 * 4_000_000


def test_nothing_to_release_with_one_torch_thread(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert openmp.release_thread_pool() is False


@pytest.mark.skipif(not page_allocators_available(), reason="transformers < 5.25: continuous batching refused")
def test_the_manager_releases_the_pool_of_the_thread_that_starts_it(monkeypatch):
    """`start()` frees the caller's pool (the thread that loaded and warmed the model) before the manager's own thread
    runs any forward, and the requests still complete."""
    from transformers_jakiro import continuous
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config

    calls = []
    monkeypatch.setattr(continuous, "release_thread_pool", lambda: calls.append(
        (threading.get_ident(), getattr(manager, "_generation_thread", None))) or True)
    target, draft = trained_pairs()("llama")
    manager = JakiroContinuousBatchingManager(target, draft, GenerationConfig(max_new_tokens=4, eos_token_id=-1),
                                              jakiro_cb_config(page_size=4, num_blocks=16))
    manager.start()
    try:
        manager.add_request([5, 6, 7], "a", max_new_tokens=4)
        result = None
        while result is None or not result.is_finished():
            result = manager.get_result(timeout=5)
            assert result is not None or manager.is_running()
    finally:
        manager.stop(block=True)
    assert calls == [(threading.get_ident(), None)]
    assert len(result.generated_tokens) == 4


def test_the_served_repositorys_code_releases_the_loading_threads_pool(monkeypatch):
    """`jakiro serve` without continuous batching: transformers imports the prepared repository's `generate.py` on the
    thread that loaded the weights (after them), and the server then decodes on its inference thread."""
    from transformers_jakiro import serve

    calls = []
    monkeypatch.setattr(openmp, "release_thread_pool", lambda: calls.append(threading.get_ident()))
    code = serve.SHIM.format(marker=serve.SHIM_MARKER, settings=repr({"draft": "/a/head"}))
    exec(compile(code, "generate.py", "exec"), {})
    assert calls == [threading.get_ident()]
