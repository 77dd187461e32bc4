"""`paged_kv.move_slots` on transformers' own paged cache (continuous batching, transformers >= 5.25): every layer's
keys and values moved in one copy, equal to moving them view by view, sources read before any write."""


import pytest
import torch
from transformers import GenerationConfig
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_models import make_target, quick_trained_draft
from transformers_jakiro.continuous_support import page_allocators_available
from transformers_jakiro.paged_kv import layer_rows, move_slots

SUPPORTED = page_allocators_available()
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="transformers < 5.25 has no page allocators")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def allocator():
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config

    target = make_target("llama", num_hidden_layers=3)
    draft = quick_trained_draft(target)
    config = GenerationConfig(do_sample=False, max_new_tokens=2, eos_token_id=-1, pad_token_id=0)
    manager = JakiroContinuousBatchingManager(target, draft, config, jakiro_cb_config(page_size=4, num_blocks=16,
                                                                                     max_batch_tokens=32))
    manager.start()
    try:
        manager.add_request([5, 6, 7], max_new_tokens=2)
        assert manager.get_result(timeout=60) is not None
        (allocator,) = manager.batch_processor.cache.cache_allocators.values()
    finally:
        manager.stop(block=True)
    return allocator


def test_transformers_layout_moves_every_layer_in_one_copy(allocator):
    views = [view for pair in allocator._kv_token_views.values() for view in pair]
    assert len(views) == 6 and layer_rows(allocator) is not None
    # slots as transformers hands them out (`get_write_indices`): a page's offsets past its block's start
    valid = [block * allocator.block_physical_stride + offset for block in (2, 3, 5)
             for offset in range(allocator.tokens_per_page)]
    torch.manual_seed(0)
    for view in views:
        view[valid] = torch.randn_like(view[valid])
    expected = [view[valid].clone() for view in views]
    picked = [9, 3, 10, 7], [3, 4, 5, 7]  # slot 3 is read before it is written; 7 stays
    for e in expected:
        e[picked[1]] = e[picked[0]].clone()
    source, target = ([valid[i] for i in indices] for indices in picked)
    counter = CountOps()
    with counter:
        move_slots(allocator, source, target)
    assert all(torch.equal(view[valid], e) for view, e in zip(views, expected))
    assert counter.names.count("index_select") == 1 and counter.names.count("index_copy_") == 1
    with CountOps() as nothing:
        move_slots(allocator, [valid[4], valid[5]], [valid[4], valid[5]])
    assert nothing.names == []


def test_views_of_another_layout_move_one_by_one(allocator, monkeypatch):
    """Where the views are not slices of one tensor, every view still gets the same move."""
    views = {layer: (keys.clone(), values.clone()) for layer, (keys, values) in allocator._kv_token_views.items()}

    class Separate:
        _kv_token_views = views

    assert layer_rows(Separate()) is None
    for keys, values in views.values():
        keys[:10].copy_(torch.arange(10.0)[:, None, None].expand_as(keys[:10]))
        values[:10].copy_(-torch.arange(10.0)[:, None, None].expand_as(values[:10]))
    move_slots(Separate(), [8, 2], [2, 3])
    for keys, values in views.values():
        assert keys[:5, 0, 0].tolist() == [0, 1, 8, 2, 4] and values[:5, 0, 0].tolist() == [0, -1, -8, -2, -4]
