"""Every distributed case runs in ranks of its own (pool.py): nothing an earlier case left is in its process, a case
that fails fails only the tests reading it, and a test selected alone runs exactly the cases it reads."""

from pathlib import Path

import pytest

from tests.distributed.harness import DistributedLaunchError
from tests.distributed.pool import shared

WORKER = Path(__file__).parent / "workers" / "isolation.py"
CASES = [{"name": "leave", "kind": "leave"}, {"name": "find", "kind": "find"}, {"name": "fail", "kind": "fail"},
         # (after the failing case; and reading the folder `leave` wrote: run after it, in a process of its own)
         {"name": "find_after_leave", "kind": "find", "root": "leave"}]
JOB = shared(2, "isolation", WORKER, {"cases": CASES}, timeout=60)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


def _assert_clean(found: dict, left: dict) -> None:
    assert found["pid"] != left["pid"]
    assert not found["process_group"]
    assert found["initial_seed"] != 1234
    assert found["linear"] == "builtin_function_or_method"
    assert found["module_attribute"] is None and found["environment"] is None


@pytest.mark.parametrize("case", ["find", "find_after_leave"])
def test_a_case_finds_nothing_of_an_earlier_case_in_its_process(results, case):
    for rank in results:
        _assert_clean(rank[case], rank["leave"])


def test_a_case_reads_the_files_of_the_case_it_names(results):
    assert all(rank["find_after_leave"]["file"] for rank in results)


def test_a_failing_case_fails_only_the_tests_reading_it_with_its_error(results):
    with pytest.raises(DistributedLaunchError, match="case fail: a rank failed") as raised:
        results[0]["fail"]
    assert "RuntimeError: this case fails on purpose" in str(raised.value)
    assert [rank["find"]["process_group"] for rank in results] == [False, False]  # a case the failing one preceded


def test_a_test_runs_exactly_the_cases_it_reads(tmp_path_factory):
    job = shared(2, "isolation_selected", WORKER, {"cases": CASES}, timeout=60)
    ranks = job.ranks(tmp_path_factory)
    assert ranks[1]["find_after_leave"]["file"]
    assert sorted(job.job.outcomes) == ["find_after_leave", "leave"]  # and what it reads first
