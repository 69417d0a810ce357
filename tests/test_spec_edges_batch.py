"""Edges of the batch layout (spec/batch.py): the layout check at its
bounds, exact refusal messages, a block of 0 rows and sequence 0 alone."""

import re

import pytest

from kvspec.spec import batch as sb
from kvspec.spec.batch import BatchLayout
from kvspec.spec.errors import InvalidArgumentError


def raises(exc, message):
    """``pytest.raises`` on the whole message: the message is the contract."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize("layout", [BatchLayout(0, (0,)), BatchLayout(3, (0, 3)), BatchLayout(2, (1, 0, 2))])
def test_a_layout_with_pads_between_0_and_idx_passes_the_check(layout):
    assert sb.check_layout(layout) is None


def test_a_batch_of_no_sequence_is_refused():
    with raises(InvalidArgumentError, "batch: a batch holds at least one sequence, got pads=()"):
        sb.check_layout(BatchLayout(2, ()))


@pytest.mark.parametrize("layout", [BatchLayout(-1, (0,)), BatchLayout(-1, (-1,)), BatchLayout(2, (3, 0)),
                                    BatchLayout(2, (0, -1))])
def test_a_pad_outside_0_to_idx_is_refused_naming_the_layout(layout):
    with raises(InvalidArgumentError, f"batch: pads must satisfy 0 <= pad <= idx ({layout.idx}), got {layout.pads}"):
        sb.check_layout(layout)


def test_the_positions_of_a_sequence_start_after_its_padding():
    layout = BatchLayout(4, (1, 0, 4))
    assert [sb.positions(layout, i) for i in range(3)] == [range(1, 4), range(4), range(4, 4)]


def test_sequence_0_alone_has_its_offset_and_positions():
    layout = BatchLayout(5, (2, 0))
    assert sb.extract(layout, 0) == (3, range(2, 5))
    assert sb.extract(layout, 1) == (5, range(5))


def test_extract_refuses_an_index_outside_the_batch():
    with raises(InvalidArgumentError, "extract: idx must be in [0, 2), got 2"):
        sb.extract(BatchLayout(5, (2, 0)), 2)
    with raises(InvalidArgumentError, "extract: idx must be in [0, 2), got -1"):
        sb.extract(BatchLayout(5, (2, 0)), -1)


def test_a_block_of_no_rows_changes_nothing_and_a_negative_block_is_refused():
    layout = BatchLayout(3, (1, 0))
    assert sb.append(layout, 0) == layout
    with raises(InvalidArgumentError, "append: n must be >= 0, got -1"):
        sb.append(layout, -1)


def test_merge_append_ragged_and_filter_refuse_with_their_rules():
    with raises(InvalidArgumentError, "merge: lengths must be one or more integers >= 0, got (2, -1)"):
        sb.merge((2, -1))
    with raises(InvalidArgumentError, "append_ragged: lengths must be 2 integers >= 0, got (1,)"):
        sb.append_ragged(BatchLayout(3, (1, 0)), (1,))
    with raises(InvalidArgumentError, "filter: keep must be distinct indices in [0, 2), got (0, 0)"):
        sb.filter(BatchLayout(3, (1, 0)), (0, 0))


@pytest.mark.parametrize("layout, left, n, message", [
    (BatchLayout(1, (0, 1)), (0, 0), 2, "announced_block: left padding is announced on an empty batch, got idx=1"),
    (BatchLayout(0, (0, 0)), (1,), 2, "announced_block: left must be 2 integers >= 0 and n >= 0, got left=(1,), n=2"),
    (BatchLayout(0, (0, 0)), (1, -1), 2, "announced_block: left must be 2 integers >= 0 and n >= 0, got left=(1, -1), n=2"),
    (BatchLayout(0, (0, 0)), (0, 0), -1, "announced_block: left must be 2 integers >= 0 and n >= 0, got left=(0, 0), n=-1"),
    (BatchLayout(0, (0, 0)), (3, 1), 2, "announced_block: a block of 2 positions is shorter than the padding (3, 1)"),
])
def test_announced_block_refuses_each_rule_on_its_own(layout, left, n, message):
    """Each refusal of an announced block alone (the others hold), with
    its message: a batch that holds positions, a left padding of the wrong
    length or below 0, a negative block, a padding past the block."""
    with raises(InvalidArgumentError, message):
        sb.announced_block(layout, left, n)


def test_announced_block_takes_a_block_as_wide_as_the_padding():
    assert sb.announced_block(BatchLayout(0, (0, 0)), (2, 0), 2) == BatchLayout(2, (2, 0))
    assert sb.offsets(sb.announced_block(BatchLayout(0, (0, 0, 0)), (1, 0, 3), 4)) == (3, 4, 1)
