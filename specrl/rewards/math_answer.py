"""Math answer checking with math-verify for user math datasets (boxed or plain answers).

math-verify's own timeouts use `signal.alarm`, which only works on the main thread; we disable
them here and bound each call with `call_with_timeout` (user_code.py) instead, which works
on any thread.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

# math-verify warns on every call that its signal-based timeout is off; we time calls ourselves.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """1.0 when the response's final answer (a \\boxed{} one first) equals the ground truth."""
    gold_text = (
        ground_truth if "\\boxed" in ground_truth or "$" in ground_truth else f"${ground_truth}$"
    )
    gold = parse(gold_text, parsing_timeout=None)
    answer = parse(solution_str, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=None))
