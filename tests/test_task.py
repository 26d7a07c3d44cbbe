import random

from specrl.data import arithmetic
from specrl.data.arithmetic import TASKS, Problem, Teacher, compute_score, solution_trace


def test_correct_trace_worked_example():
    assert solution_trace(Problem(4738, 95)) == "8+5+0=13;3+9+1=13;7+0+1=8;4+0+0=4;#4833"
    assert solution_trace(Problem(99, 1)) == "9+1+0=10;9+0+1=10;#100"


def test_correct_traces_score_one_and_forgetful_traces_are_wrong_only_when_a_carry_is_dropped():
    rng = random.Random(0)
    for _ in range(500):
        problem = arithmetic.sample_problem(rng)
        assert compute_score("", solution_trace(problem), problem.answer) == 1.0
        forgetful = solution_trace(problem, rng, Teacher(p_forget_carry=1.0))
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


def test_a_noisy_facts_teacher_gets_only_its_noisy_facts_wrong_each_as_often_as_it_says():
    teacher = TASKS["noisy_facts"].teacher
    errors = teacher.fact_errors
    assert len(errors) == 40 and errors == Teacher(noisy_facts=0.2).fact_errors  # fixed by seed
    assert all(
        0.5 <= p <= 0.95 and abs(w - (x + y + c)) == 1 for (x, y, c), (p, w) in errors.items()
    )
    (x, y, _), (p, wrong) = next((f, e) for f, e in errors.items() if f[2] == 0)
    problem = Problem(10 * 1 + x, 10 * 2 + y)  # the ones column is the noisy fact, no carry in
    rng = random.Random(0)
    traces = [solution_trace(problem, rng, teacher) for _ in range(4000)]
    wrong_column = f"{x}+{y}+0={wrong};"
    share = sum(t.startswith(wrong_column) for t in traces) / len(traces)
    assert abs(share - p) < 0.03
    assert all(t.startswith(wrong_column) or t.startswith(f"{x}+{y}+0={x + y};") for t in traces)
    clean = Problem(11, 11)  # 1+1+0 twice: a fact the teacher always gets right unless noisy
    if (1, 1, 0) not in errors:
        assert solution_trace(clean, rng, teacher) == solution_trace(clean)
