import random

from specrl.data import arithmetic
from specrl.data.arithmetic import Problem, compute_score, solution_trace


def test_correct_trace_worked_example():
    assert solution_trace(Problem(4738, 95)) == "8+5+0=13;3+9+1=13;7+0+1=8;4+0+0=4;#4833"
    assert solution_trace(Problem(99, 1)) == "9+1+0=10;9+0+1=10;#100"


def test_correct_traces_score_one_and_forgetful_traces_are_wrong_only_when_a_carry_is_dropped():
    rng = random.Random(0)
    for _ in range(500):
        problem = arithmetic.sample_problem(rng)
        assert compute_score("", solution_trace(problem), problem.answer) == 1.0
        forgetful = solution_trace(problem, rng, p_forget_carry=1.0)
        has_carry = "+1=" in solution_trace(problem)
        assert compute_score("", forgetful, problem.answer) == (0.0 if has_carry else 1.0)


def test_checker_reads_the_answer_after_the_last_hash():
    assert compute_score("", "1+2+0=3;#3", "3") == 1.0
    assert compute_score("", "1+2+0=3;#4", "3") == 0.0
    assert compute_score("", "1+2+0=3;", "3") == 0.0


def test_split_is_deterministic_and_disjoint():
    train, test = arithmetic.make_split(5, 300, 100)
    assert (train, test) == arithmetic.make_split(5, 300, 100)
    assert not set(train) & set(test)
    assert len(set(train)) == 300 and len(set(test)) == 100
    assert arithmetic.make_split(6, 300, 100)[1] != test
