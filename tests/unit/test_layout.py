import pytest

from lightning_ulysses.parallel.layout import ParallelLayout


def test_sp_major_groups_stay_contiguous():
    layout = ParallelLayout(world_size=8, sequence_parallel_size=4)
    assert layout.data_parallel_size == 2
    assert layout.sequence_parallel_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.sequence_parallel_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert str(layout) == "dp(2) × sp(4) = world_size(8)"


def test_world_not_divisible_names_valid_sizes():
    with pytest.raises(ValueError, match=r"sp\(4\) does not divide world_size\(6\).*\[1, 2, 3, 6\]"):
        ParallelLayout(world_size=6, sequence_parallel_size=4)


@pytest.mark.parametrize("size", [0, -2, 1.5, "2", True])
def test_sequence_parallel_size_must_be_positive_int(size):
    with pytest.raises(ValueError, match="sequence_parallel_size must be an integer >= 1"):
        ParallelLayout(world_size=4, sequence_parallel_size=size)
