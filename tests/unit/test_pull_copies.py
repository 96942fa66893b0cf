"""PullCopies: one copy per version, buffers reused only once nothing else holds them."""

from __future__ import annotations

import pytest
import torch

from ps.core.pull_copies import PullCopies

pytestmark = pytest.mark.timeout(30)


def _masters(value: float) -> list[torch.Tensor]:
    return [torch.full((1000,), value), torch.full((10,), value)]


def test_one_copy_per_version_shared_by_every_pull() -> None:
    copies = PullCopies(torch.float32)
    masters = _masters(1.0)
    first = copies.for_version(1, masters)
    masters[0].fill_(2.0)  # an update in place: the copy must not follow it
    assert copies.for_version(1, masters) is first
    assert float(first[0][0]) == 1.0


def test_a_set_nobody_holds_is_reused_and_rewritten() -> None:
    copies = PullCopies(torch.float32)
    v1 = copies.for_version(1, _masters(1.0))
    pointers = [t.data_ptr() for t in v1]
    del v1
    copies.for_version(2, _masters(2.0))  # v1's set is idle but was current: a second set
    v3 = copies.for_version(3, _masters(3.0))
    assert [t.data_ptr() for t in v3] == pointers
    assert float(v3[0][0]) == 3.0 and float(v3[1][-1]) == 3.0
    assert copies.sets == 2


def test_a_set_a_reply_still_holds_is_never_rewritten() -> None:
    copies = PullCopies(torch.float32)
    reply = copies.for_version(1, _masters(1.0))  # a reply not serialised yet holds the list
    copies.for_version(2, _masters(2.0))
    copies.for_version(3, _masters(3.0))
    assert float(reply[0][0]) == 1.0
    assert copies.sets == 3


def test_a_tensor_the_wire_still_holds_is_never_rewritten() -> None:
    copies = PullCopies(torch.float32)
    v1 = copies.for_version(1, _masters(1.0))
    on_the_wire = [v1[0].view(-1)]  # what an RPC message keeps: a reference to the tensor, not the list
    del v1
    copies.for_version(2, _masters(2.0))
    copies.for_version(3, _masters(3.0))
    assert float(on_the_wire[0][0]) == 1.0
    del on_the_wire
    copies.for_version(4, _masters(4.0))  # the first set is idle again: reused (the second dropped), no fourth
    assert copies.sets == 2


def test_idle_sets_beyond_the_one_reused_are_dropped() -> None:
    copies = PullCopies(torch.float32)
    held = [copies.for_version(v, _masters(float(v))) for v in range(1, 5)]
    assert copies.sets == 4
    del held
    copies.for_version(5, _masters(5.0))  # three idle sets besides the current: one reused, two dropped
    assert copies.sets == 2  # the reused one and version 4's (the spare for the next version)


def test_invalidate_copies_again_at_the_same_version() -> None:
    copies = PullCopies(torch.float32)
    masters = _masters(1.0)
    copies.for_version(7, masters)
    masters[0].fill_(9.0)  # a restored snapshot
    copies.invalidate()
    assert float(copies.for_version(7, masters)[0][0]) == 9.0


def test_copies_in_the_wire_dtype() -> None:
    assert PullCopies(torch.bfloat16).for_version(1, _masters(1.5))[0].dtype == torch.bfloat16
