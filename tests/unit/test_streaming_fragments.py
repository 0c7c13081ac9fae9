"""StreamingDiLoCo's fragments: every parameter in exactly one, in order, none empty, about
equal in elements; and the fragment counts it refuses."""

import pytest
import torch

from ddp_course.local_sgd import StreamingDiLoCo
from ddp_course.models import TinyGPT


def streaming(fragments, sync_every=None):
    model = TinyGPT(d_model=64, n_heads=4, n_layers=2, seq_len=64)
    inner = torch.optim.AdamW(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    return model, StreamingDiLoCo(model, inner, outer, sync_every or fragments, fragments)


@pytest.mark.parametrize("fragments", [1, 2, 3, 5, 10, 37])
def test_fragments_cover_every_parameter_once_in_order_and_none_is_empty(fragments):
    model, s = streaming(fragments)
    assert len(s.fragments) == fragments and all(s.fragments)
    assert [i for f in s.fragments for i in f] == list(range(len(list(model.parameters()))))


def test_fragments_hold_about_equal_elements():
    model, s = streaming(5)
    sizes = [sum(list(model.parameters())[i].numel() for i in f) for f in s.fragments]
    total = sum(sizes)
    assert all(abs(n - total / 5) < 0.3 * total / 5 for n in sizes), sizes


@pytest.mark.parametrize(("fragments", "sync_every"), [(0, 10), (3, 10), (38, 38)])
def test_a_fragment_count_that_does_not_fit_is_refused(fragments, sync_every):
    with pytest.raises(ValueError, match="fragments must be at least 1, divide sync_every"):
        streaming(fragments, sync_every)
