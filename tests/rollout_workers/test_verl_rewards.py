"""rollout.reward=verl scores a verl user's rows as verl's default_compute_score does, without verl: each
case's expected value is what verl's own function (verl 1dda039) returned for it, and the rules agreed
with verl's functions on 200,000 random texts when they were written. Rows of a data_source it has no
rule for are named with the reason, and fail as a reward error, not as a crash."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_workers.data.problems import Problem
from rollout_workers.rewards import Reward, RewardRunner, Scored
from rollout_workers.verl_rewards import (_time_limit, hendrycks_math_reward, math_dapo_reward, prime_math_reward,
                                          prime_math_score, search_r1_reward, verl_default_reward, why_unscorable,
                                          why_unscorable_row)


@pytest.mark.parametrize("response,reference,expected", [
    ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # 0.5 and a/b are written as \frac
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{03/4}", "\\frac{3}{4}", 0.0),  # a/b only where both are integers written plainly
    ("\\boxed{x = 5}", "5", 1.0),  # a short "x = " is dropped
    ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units after "\text{ "
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{.5}", "0.5", 1.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt}", "\\sqrt", 1.0),  # not normalisable: compared as they are
    ("\\boxed{1} then \\boxed{\\left( 2, 3 \\right)}", "(2,3)", 1.0),  # the last box
    ("it is \\boxed 5$ done", "5", 1.0),  # the spaced form, up to a '$'
    ("\\fbox{5}", "5", 0.0),  # found but not read, as in verl
    ("\\boxed{5", "5", 0.0),  # never closed
    ("the answer is 5", "5", 0.0),  # MATH's rule reads only a box
    ("\\boxed{5}", 5, 0.0),  # a reference that is no text equals no text
])
def test_math_rows_score_as_verls_math_reward(response, reference, expected):
    assert hendrycks_math_reward(response, reference) == expected
    assert verl_default_reward("lighteval/MATH", response, reference) == expected


@pytest.mark.parametrize("response,reference,score,said", [
    ("Answer: 5", "5", 1.0, "5"),
    ("so answer : 1,000 dollars", "1000", 1.0, "1000"),  # normalised: units and thousands' commas out
    ("ANSWER: $x=7$", "7", 1.0, "7"),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("The answer is \\boxed{5}", "5", 1.0, "5"),  # no "Answer:" line: the last box
    ("\\boxed{ 5}", "5", -1.0, " 5"),  # a box is compared as it is
    ("\\boxed{5}" + "." * 100, "5", -1.0, "[INVALID]"),  # the box is looked for in the last 100 characters
    ("Answer: 4\nthen \\boxed{5}", "5", -1.0, "4"),  # an "Answer:" line wins over a box
    ("no answer", "5", -1.0, "[INVALID]"),
])
def test_dapo_and_aime_rows_score_as_verls_math_dapo(response, reference, score, said):
    expected = {"score": score, "acc": score > 0, "pred": said}
    assert math_dapo_reward(response, reference) == expected
    for source in ("math_dapo", "aime2024", "aime_2025"):
        assert verl_default_reward(source, response, reference) == expected


@pytest.mark.parametrize("response,targets,expected", [
    ("<answer>The Eiffel Tower!</answer>", ["eiffel tower"], 1.0),  # case, punctuation and articles aside
    ("<answer>a</answer> <answer> an  apple </answer>", ["apple"], 1.0),  # the last answer
    ("<answer>Paris</answer>", ["London", "Rome"], 0.0),
    ("Paris", ["Paris"], 0.0),  # no <answer> tags
    ("<answer>x</answer>" * 11, "X", 0.25),  # more than 10 tags: a quarter
])
def test_search_r1_rows_score_as_verls_exact_match(response, targets, expected):
    assert search_r1_reward(response, {"target": targets}) == expected
    assert verl_default_reward("searchR1_nq", response, {"target": targets}) == expected
    with pytest.raises(ValueError, match="ground_truth is {'target': \\[answers\\]}"):
        search_r1_reward(response, "Paris")


def test_gsm8k_rows_take_verls_strict_rule():
    assert verl_default_reward("openai/gsm8k", "so #### 1,072", "1072") == 1.0
    assert verl_default_reward("openai/gsm8k", "the answer is 1072", "1072") == 0.0


# (response, reference, what verl's prime_math.compute_score returned: correct, formatted, the answer read)
@pytest.mark.parametrize("response,reference,expected", [
    ('The answer is \\boxed{\\frac{1}{2}}', '0.5', (True, True, '\\frac{1}{2}')),
    ('Answer: 2/4', '\\frac{1}{2}', (False, False, '2/4')),
    ('\\boxed{\\frac{2}{4}}', '\\frac{1}{2}', (False, False, '\\frac{2}{4}')),
    ('so x = 2\\pi', '6.28', (True, False, '2\\pi')),
    ('\\boxed{6.28}', '2\\pi', (True, False, '6.28')),
    ('\\boxed{3.14}', '\\pi', (True, False, '3.14')),
    ('\\boxed{6.2832}', '2\\pi', (True, False, '6.2832')),
    ('The answer is (1, 2).', '(1,2)', (False, False, '(1, 2).')),
    ('\\boxed{[1, 3)}', '[1,3)', (True, True, '[1, 3)')),
    ('\\boxed{(1, 3]}', '[1,3)', (False, False, '(1, 3]')),
    ('\\boxed{Interval.Ropen(1, 3)}', '[1, 3)', (True, False, 'Interval.Ropen(1, 3)')),
    ('\\boxed{Point(1, 2)}', '(1, 2)', (False, False, 'Point(1, 2)')),
    ('\\boxed{[1, 2]}', '\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}', (False, False, '[1, 2]')),
    ('\\boxed{Matrix([[1], [2]])}', '\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}', (True, False, 'Matrix([[1], [2]])')),
    ('\\boxed{101_2}', '101', (True, False, '101_2')),
    ('Answer: 50\\%', '0.5', (True, False, '50\\%')),
    ('Answer: 50%', '50', (True, True, '50%')),
    ('the answer is $1,000', '1000', (True, True, '$1,000')),
    ('\\boxed{5\\text{ cm}}', '5', (True, True, '5\\text{ cm}')),
    ('\\boxed{5 centimeters}', '5', (True, True, '5 centimeters')),
    ('x + 1 is the answer', '1+x', (True, True, 'x + 1')),
    ('\\boxed{7 3/4}', '\\frac{31}{4}', (True, True, '7 3/4')),
    ('\\boxed{x^2+2x+1}', '(x+1)^2', (True, True, 'x^2+2x+1')),
    ('\\boxed{a^2+2ab+b^2+c}', '(a+b)^2+c', (False, False, 'a^2+2ab+b^2+c')),
    ('\\boxed{\\sqrt{2}/2}', '\\frac{1}{\\sqrt{2}}', (True, True, '\\sqrt{2}/2')),
    ('\\boxed{5 million}', '5000000', (False, False, '5 million')),
    ('\\boxed{2^{10}}', '1024', (False, False, '2^{10}')),
    ('\\boxed{B}', '\\text{B}', (True, True, 'B')),
    ('\\boxed{3 or 4}', '3, 4', (False, False, '3 or 4')),
    ('\\boxed{4, 3}', '3, 4', (False, False, '4, 3')),
    ('\\boxed{5.00001}', '5', (True, False, '5.00001')),
    ('\\boxed{5.001}', '5', (False, False, '5.001')),
    ('\\boxed{12}', 12, (True, True, '12')),
    ('no answer here', '5', (False, False, 'no answer here')),
    ('Step 2: so \\boxed{6}', '7', (False, True, '6')),
    ('\\boxed{\\infty}', '\\infty', (True, True, '\\infty')),
    ('It is 5. Then 7', '7', (False, False, '5')),
    ('\\boxed{x \\in [1, 2]}', '[1, 2]', (False, False, 'x \\in [1, 2]')),
])
def test_numina_rows_score_as_verls_prime_math(response, reference, expected):
    assert prime_math_score(response, reference) == expected
    assert verl_default_reward("numina_olympiads", response, reference) == float(expected[0])


def test_prime_math_never_runs_a_models_answer_as_code(tmp_path):
    """Where verl's prime_math hands the answer to Python's eval or sympy's parse_expr, etarl's evaluates
    plain values only: the code in these answers would write the file."""
    ran = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(ran)!r}).write_text('1')"
    as_format = 'frac(f"' + "".join("{%d:c}" % ord(c) for c in code) + '")'  # two letters, as prm800k's guard lets
    escaped = code.replace("_", "\\x5f")  # no '_': a base's subscript would end the grading first
    matrix = "\\begin{pmatrix} 1 \\end{pmatrix}"
    for response, reference in [(f"\\boxed{{[{code}]}}", matrix),  # verl: eval
                                (f"\\boxed{{{code}\\pi}}", "\\pi"),  # verl: eval
                                (f"\\boxed{{Matrix([{code}])}}", matrix),  # verl: sympy's parse_expr
                                (f'\\boxed{{Matrix([sin("{escaped}")])}}', matrix),  # sympy's sin sympifies a text
                                (f"The answer is \\boxed{{{as_format}}}", "1/2")]:  # prm800k's sympy comparison
        assert prime_math_reward(response, reference) == 0.0
        assert not ran.exists(), response
    assert prime_math_reward("\\boxed{Matrix(1, 1, print)}", matrix) == 0.0  # sympy would call print(0, 0)
    assert prime_math_reward("\\boxed{[2**10**9]}", matrix) == 0.0  # refused, not computed for minutes


def test_numina_rows_score_in_the_workers_reward_process_under_its_limits():
    runner = RewardRunner("verl", timeout_s=30)  # the worker's: a child process, CPU and memory limits
    try:
        row = Problem("?", "(x+1)^2", data_source="numina_olympiads")
        assert runner.score_one("\\boxed{x^2+2x+1}", row) == Scored(1.0, {}), runner.last_error  # by sympy
        assert runner.score_one("\\boxed{x^2+2x}", row) == Scored(0.0, {}), runner.last_error
        assert runner.stats()["reward_failures_total"] == 0
    finally:
        runner.close()


def test_a_sympy_comparison_is_cut_at_its_time_limit_in_a_main_thread():
    """In a process of its own (pytest-timeout's timer holds this one's, where the limit stands aside)."""
    script = """
import time
from rollout_workers.verl_rewards import _time_limit
deadline = time.monotonic() + 30
try:
    with _time_limit(0.05):
        while time.monotonic() < deadline:  # bounded: the limit ends it long before
            pass
except TimeoutError:
    print("cut", time.monotonic() < deadline)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "cut True", done.stderr


def test_the_built_in_verl_reward_is_called_in_verls_form_and_logs_dapos_accuracy():
    reward = Reward("verl")
    assert reward.form == "verl"
    scored = reward("Answer: 5", Problem("?", "5", data_source="math_dapo"))
    assert scored.value == 1.0 and scored.metrics == {"reward/acc": 1.0}  # pred is text: not a metric
    assert reward("#### 3", Problem("?", "3", data_source="openai/gsm8k")).value == 1.0
    with pytest.raises(ValueError, match="cannot take rollout.reward_kwargs"):
        Reward("verl", {"method": "flexible"})


def test_rows_it_cannot_score_are_named_with_what_to_do():
    rows = [("openai/gsm8k", "4", None), ("aime25", "7", None),
            ("numina_olympiads", "1", None), ("numina_cn_k12", 12, None),  # prime_math reads str(ground_truth)
            ("numina_amc_aime", None, "its ground_truth is missing"),
            ("taco", "x", "its ground_truth is not JSON test cases"),
            ("apps", '{"inputs": ["1"], "outputs": ["1"]}', None),
            ("codeforces", {"inputs": ["1"], "outputs": []}, "its ground_truth has 1 inputs and 0 outputs"),
            ("codecontests", '{"inputs": [], "outputs": []}', "its ground_truth has 0 inputs and 0 outputs"),
            ("taco", '{"inputs": [["1"]], "outputs": ["1"]}', "its ground_truth's input 0 is list, not text"),
            ("taco", '{"fn_name": 3, "inputs": ["1"], "outputs": ["1"]}', "its ground_truth's fn_name is int"),
            ("hiyouga/geometry3k", "3", "verl scores it with geo3k"),
            ("my_set", "1", "verl's default reward has no rule for it either"), ("", "1", "rows without a data_source"),
            ("lighteval/MATH", 5, "its ground_truth is a number, not text"),
            ("aime24", ["7"], "its ground_truth is a list, not text"), ("searchR1_nq", {"target": ["Paris"]}, None),
            ("searchR1_nq", {"target": []}, "its ground_truth is not {'target': [answers]}"),
            ("searchR1_nq", "Paris", "its ground_truth is not {'target': [answers]}")]
    for source, reference, why in rows:
        said = why_unscorable_row(source, reference)
        if why is None:
            assert said is None, source
        else:
            assert said.startswith(f"rollout.reward=verl cannot score it: data_source {source!r}: {why}"), said
    assert "verl.utils.reward_score:default_compute_score with verl installed" in why_unscorable("hiyouga/geometry3k")
    with pytest.raises(ValueError, match="cannot score data_source 'my_set': verl's default reward has no rule"):
        verl_default_reward("my_set", "Answer: 1", "1")


VERL_WRITTEN_REWARD = '''
from verl.utils.reward_score import default_compute_score, math_dapo, prime_math
from verl.utils.reward_score.math_reward import is_equiv, last_boxed_only_string, remove_boxed
from verl.utils.reward_score.prime_math.grader import math_equal


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "my_math":
        boxed = last_boxed_only_string(solution_str)
        return float(boxed is not None and is_equiv(remove_boxed(boxed), ground_truth))
    if data_source == "lazy":
        from verl.utils.reward_score import gsm8k  # imported when called, as verl's own code does
        return gsm8k.compute_score(solution_str, ground_truth)
    if data_source == "strict":
        return math_dapo.compute_score(solution_str, ground_truth, strict_box_verify=True)
    if data_source == "prime":
        correct, _, answer = prime_math.compute_score(solution_str, ground_truth)
        return float(correct or math_equal(answer, ground_truth, timeout=True))
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def test_a_reward_file_written_against_verls_reward_score_loads_and_scores_without_verl(tmp_path):
    import importlib.util
    import sys

    assert importlib.util.find_spec("verl") is None  # etarl's stand-ins, not verl
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_WRITTEN_REWARD)
    reward = Reward(f"{path}:compute_score")
    assert "verl" not in sys.modules  # stood in while it loaded, not after
    cases = [("my_math", "so \\boxed{\\frac12}", "0.5", 1.0), ("lazy", "#### 7", "7", 1.0),
             ("strict", "\\boxed{3}", "3", 1.0), ("math_dapo", "Answer: 3", "4", -1.0),
             ("openai/gsm8k", "#### 9", "9", 1.0), ("prime", "the answer is 2/4", "\\frac{1}{2}", 0.0),
             ("prime", "the answer is $1,000", "1000", 1.0), ("numina_olympiads", "\\boxed{6.28}", "2\\pi", 1.0)]
    for source, response, reference, value in cases:
        assert reward(response, Problem("?", reference, data_source=source)).value == value, source
    assert "verl" not in sys.modules
    path.write_text("from verl.utils.reward_score.sandbox_fusion import compute_score\n")
    with pytest.raises(ValueError, match=r"No module named 'verl.utils.reward_score.sandbox_fusion' \(etarl stands in "
                                         r"for .*verl.utils.reward_score .*anything else of verl needs verl installed"):
        Reward(f"{path}:compute_score")
