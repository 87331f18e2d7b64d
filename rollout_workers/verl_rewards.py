"""verl's default reward without verl: `rollout.reward=verl` scores each row by its data_source with the
rule `verl.utils.reward_score.default_compute_score` uses for it, so a verl user's GSM8K, MATH, DAPO/AIME,
Search-R1, PRIME (Eurus-2-RL-Data's math and code) and code-contest files score in etarl as they score in verl:

  openai/gsm8k                                    gsm8k_reward: the number after the last '#### '
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                                  hendrycks_math_reward: the last \\boxed{},
                                                  equal after the MATH normalisation; 1.0 or 0.0
  math_dapo, math, math_dapo_reasoning, aime*     math_dapo: "Answer: ..." (else the last \\boxed{}, as
                                                  verl since August 2026, #7407) in the last 300
                                                  characters; {score: 1.0 or -1.0, acc}
  searchR1_nq, searchR1_triviaqa, ...             search_r1: the last <answer>...</answer>, an exact
                                                  match of ground_truth["target"] after normalising
  numina_aops_forum, numina_olympiads, ...        prime_math: the answer after the last "answer is"
                                                  or in the last box, graded by prm800k's rule (sympy
                                                  within 10 s), else ToRA's math_equal; 1.0 or 0.0
  codecontests, apps, codeforces, taco            prime_code (rollout_workers/code_tests.py): the
                                                  response's program run on the row's tests; 1.0, or
                                                  the fraction of the first 10 passed one by one

The rules are written from verl's behaviour (verl 1dda039) and checked against verl's functions on
random texts (prime_code on programs against verl's harness). verl's geometry3k rule needs more than
Python (mathruler, and images): its rows, and rows of a data_source verl has no rule for, are bad rows
(`why_unscorable_row`, with rows whose reference their rule cannot read: refused when a run starts, or
skipped with rollout.task.skip_invalid), and fail as a reward error if one reaches a worker.
In a multi-turn tools run the rule reads the answer turn, where verl reads the whole response (a
Search-R1 answer in an earlier turn, or its tag count, differ there).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import logging
import math
import operator
import re
import signal
import string
import threading
import types
from typing import Any

from rollout_workers.code_tests import CODE_SOURCES, prime_code_reward, why_bad_tests

# ---------------------------------------------------------------- openai/gsm8k
_GSM8K_TAIL = 300  # characters verl's rule reads at the end of a response
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_FLEXIBLE = re.compile(r"-?[0-9.,]+")


def gsm8k_answer(response: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K rule reads in the response's last 300 characters: the number after the last
    '#### ' without its commas (strict), or the last run of digits, dots and commas that is not '.'
    (flexible); None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method is {method!r}, not strict or flexible")
    tail = response[-_GSM8K_TAIL:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _GSM8K_FLEXIBLE.findall(tail)
    return next((x for x in reversed(found) if x != "."), found[0] if found else None)


def gsm8k_reward(response: str, answer: str, method: str = "strict", format_score: float = 0.0,
                 score: float = 1.0) -> float:
    """verl's rule for openai/gsm8k (its default reward for that data_source): gsm8k_answer compared as
    text with the answer: `score` when equal, `format_score` when not, 0 when there is none."""
    final = gsm8k_answer(response, method)
    if final is None:
        return 0.0
    return float(score) if final == answer else float(format_score)


# ---------------------------------------------------------------- \boxed{} answers
def _closing_brace(text: str, start: int) -> int | None:
    """The index of the '}' that brings the braces counted from `start` back to zero, as verl walks them
    (a '}' seen before any '{' counts below zero); None when none does."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_math(text: str) -> str | None:
    """What verl's MATH rule takes as the last boxed answer, with its wrapper: '\\boxed ' and what follows
    the last one up to a '$' when the text has that spaced form at all; else from the last '\\boxed'
    (or, without one, the last '\\fbox') to its closing brace."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    box = _last_box(text)
    return None if box is None else text[box[0]:box[1] + 1]


def _last_box(text: str) -> tuple[int, int] | None:
    """(the start of the last '\\boxed', else of the last '\\fbox'; the index of its closing brace), None
    where there is none or it never closes."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = _closing_brace(text, start)
    return None if end is None else (start, end)


def last_boxed(text: str) -> str | None:
    """The last '\\boxed{...}' of a text (DAPO's rule), braces balanced; None without a closed one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = _closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def unboxed(boxed: str) -> str:
    """The inside of '\\boxed{...}' or the rest of '\\boxed ...'; ValueError for anything else (an
    '\\fbox{}' among them: verl's MATH rule finds it but cannot read it, so it scores 0)."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a boxed answer: {boxed!r:.80}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r:.80}")
    return boxed[len("\\boxed{"):-1]


# ---------------------------------------------------------------- Hendrycks' MATH (verl's math_reward)
_MATH_CLEANUPS = (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                  ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))


def _math_fracs(text: str) -> str:
    """'\\frac12' -> '\\frac{1}{2}', '\\frac1{72}' -> '\\frac{1}{72}'; the text unchanged where a '\\frac'
    has one character after it; IndexError where it has none (the caller then compares raw texts)."""
    head, *fracs = text.split("\\frac")
    out = [head]
    for frac in fracs:
        if frac[0] == "{":
            out.append("\\frac" + frac)
        elif len(frac) < 2:
            return text
        elif frac[1] == "{":
            out.append("\\frac{" + frac[0] + "}" + frac[1:])
        else:
            out.append("\\frac{" + frac[0] + "}{" + frac[1] + "}" + frac[2:])
    return "".join(out)


def _math_slash_fraction(text: str) -> str:
    """'3/4' -> '\\frac{3}{4}' where both sides are integers written as Python writes them."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _math_sqrts(text: str) -> str:
    """'\\sqrt3' -> '\\sqrt{3}'; IndexError for a '\\sqrt' at the end."""
    head, *roots = text.split("\\sqrt")
    return head + "".join("\\sqrt" + root if root[0] == "{" else "\\sqrt{" + root[0] + "}" + root[1:]
                          for root in roots)


def math_normalized(answer: str) -> str:
    """An answer in Hendrycks' MATH normal form (lm-evaluation-harness's, verl's math_reward): no line
    breaks, \\left/\\right, degrees, dollars, units after '\\text{ ', percent signs or spaces; tfrac and
    dfrac as frac; '.5' as '0.5'; a short 'x = ' dropped; \\frac and \\sqrt arguments braced; 0.5 and
    a/b as \\frac. Raises (AttributeError, IndexError, ValueError) where verl's raises."""
    for old, new in _MATH_CLEANUPS:
        answer = answer.replace(old, new)
    if "\\text{ " in answer:  # units: "5 \\text{ cm}"; twice is not a form the rule knows
        before, *after = answer.split("\\text{ ")
        if len(after) != 1:
            raise ValueError("'\\text{ ' more than once")
        answer = before
    answer = answer.replace("\\\\%", "").replace("\\%", "")
    answer = answer.replace(" .", " 0.").replace("{.", "{0.")
    if not answer:
        return answer
    if answer[0] == ".":
        answer = "0" + answer
    sides = answer.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5", "x=3"
        answer = sides[1]
    if "\\sqrt" in answer:
        answer = _math_sqrts(answer)
    answer = _math_fracs(answer.replace(" ", ""))
    if answer == "0.5":
        answer = "\\frac{1}{2}"
    return _math_slash_fraction(answer)


def math_equivalent(answer: Any, reference: Any) -> bool:
    """Equal in MATH normal form; equal as they are where either cannot be normalised (verl's is_equiv)."""
    if answer is None or reference is None:
        return answer is None and reference is None
    try:
        return math_normalized(answer) == math_normalized(reference)
    except Exception:  # noqa: BLE001 - any failure of the normalisation: verl then compares the raw values
        return answer == reference


def hendrycks_math_reward(solution_str: str, ground_truth: Any) -> float:
    """verl's rule for MATH rows: 1.0 when the last boxed answer is math_equivalent to the reference, else
    0.0 (also where the boxed answer cannot be read)."""
    boxed = last_boxed_math(solution_str)
    if boxed is None:
        return 0.0
    try:
        return float(math_equivalent(unboxed(boxed), ground_truth))
    except ValueError:
        return 0.0


# ---------------------------------------------------------------- DAPO (verl's math_dapo)
_DAPO_TAIL = 300  # characters the rule reads (MATH-500's longest answer is 159)
_DAPO_BOX_TAIL = 100  # of those, where the \boxed{} fallback looks
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_INVALID = "[INVALID]"
_DAPO_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
# Words and marks dropped from an answer (Minerva's list, as verl keeps it): units, "ways", dots ...
_DAPO_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
                 ",\\!", "{,}", '"', "\\dots")
_DAPO_REWRITES = ((re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep what the first $...$ holds
                  (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"), (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
                  (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"), (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
                  (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
                  (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"))  # \sqrta -> \sqrt{a}


def dapo_normalized(answer: str) -> str:
    """A final answer in the Minerva normal form DAPO's rule compares: what follows the last '=', without
    articles, spaces, units and formatting, shorthand TeX braced, '$' dropped, '1,000' as '1000'."""
    answer = answer.split("=")[-1]
    for old, new in _DAPO_REPLACED:
        answer = answer.replace(old, new)
    for dropped in _DAPO_DROPPED:
        answer = answer.replace(dropped, "")
    for pattern, replacement in _DAPO_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _dapo_boxed(tail: str, reference: Any, pause_tokens_index: list[int] | None) -> tuple[bool, str | None]:
    """(correct, the box read): the last \\boxed{} of the last 100 characters (of those before the last
    pause token's, with `pause_tokens_index`), compared with the reference as it is."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index holds 4 indices, not {len(pause_tokens_index)}")
        window = tail[pause_tokens_index[-1] - _DAPO_BOX_TAIL:]
    else:
        window = tail[-_DAPO_BOX_TAIL:]
    boxed = last_boxed(window)
    inside = None if boxed is None else boxed[len("\\boxed{"):-1]
    return inside == reference, inside


def _dapo_verdict(tail: str, reference: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    """(correct, the answer read): the last 'Answer: ...' line normalised and compared with the normalised
    reference; without one (or with strict_box_verify, only), the box of _dapo_boxed."""
    if strict_box_verify:
        return _dapo_boxed(tail, reference, pause_tokens_index)
    found = _DAPO_ANSWER.findall(tail)
    said = dapo_normalized(found[-1] if found else _DAPO_INVALID)
    said_correct = said == dapo_normalized(reference)
    if said != _DAPO_INVALID:
        return said_correct, said
    box_correct, inside = _dapo_boxed(tail, reference, pause_tokens_index)
    if inside is not None:
        return box_correct, inside
    return said_correct, said


def math_dapo_reward(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                     pause_tokens_index: list[int] | None = None) -> dict:
    """verl's rule for DAPO and AIME rows: {"score": 1.0 when correct else -1.0, "acc": correct, "pred":
    the answer read} from the response's last 300 characters (see _dapo_verdict)."""
    correct, said = _dapo_verdict(solution_str[-_DAPO_TAIL:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": said}


# ---------------------------------------------------------------- Search-R1 (verl's search_r1_like_qa_em)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_MAX_ANSWER_TAGS = 10  # more opening or closing tags than this quarters a right answer's score


def qa_normalized(text: str) -> str:
    """SQuAD's answer normal form: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def search_r1_answer(solution_str: str) -> str | None:
    """The last <answer>...</answer> of a response, stripped; None without one."""
    answers = _ANSWER_TAG.findall(solution_str)
    return answers[-1].strip() if answers else None


def exact_match(prediction: str, answers: Any) -> int:
    """1 when the prediction equals one of `answers` (one answer or a list) after qa_normalized, else 0."""
    answers = [answers] if isinstance(answers, str) else answers
    said = qa_normalized(prediction)
    return int(any(qa_normalized(answer) == said for answer in answers))


def search_r1_reward(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                     score: float = 1.0) -> float:
    """verl's rule for Search-R1 rows: the last <answer>...</answer> matched exactly (after qa_normalized)
    against ground_truth["target"] (one answer or a list): `score` when one matches (a quarter of it past
    10 opening or closing tags), `format_score` when none does, 0 without an answer. `method` is taken and
    unused, as in verl."""
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise ValueError(f"a Search-R1 row's ground_truth is {{'target': [answers]}}, not {ground_truth!r:.100}")
    said = search_r1_answer(solution_str)
    if said is None:
        return 0
    if not exact_match(said, ground_truth["target"]):
        return format_score
    if max(solution_str.count("<answer>"), solution_str.count("</answer>")) > _MAX_ANSWER_TAGS:
        return score / 4
    return score


# ---------------------------------------------------------------- numina_* (verl's prime_math)
# PRIME's grader: prm800k's grade_answer, then ToRA's math_equal. Where verl runs Python's eval or sympy's
# parse_expr on a model's answer, these evaluate plain values only (numbers, arithmetic, comparisons, brackets;
# for sympy also symbols and its elementary functions): the same results, without running a model's code.
_PRIME_AFTER = ("answer:", "answer is", "answers are")  # the answer follows the last of each
_PRIME_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")  # ... precedes it
_PRIME_LAST_AFTER = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
_PRIME_REPLACED = (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                   ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_PRIME_UNITS = [re.compile(f"{unit}(es)?(s)? *(\\^[0-9]+)?") for unit in (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
    "foot", "feet", "inch", "yard", "liter")]
_PRIME_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_PRIME_ENCLOSING_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_PRIME_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_PRIME_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_PRIME_UNSAFE = ("^{", "^(")  # exponent forms sympy may hang on: not tried
_PRIME_UNSAFE_POWERS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_PRIME_SYMPY_S = 10.0  # verl's limit on one sympy comparison
_PRIME_PI_VALUES = (math.pi, 3.14)  # a \pi answer is right with either
_PRIME_MAX_CHARS = 1000  # of an answer that math_equal compares


def prime_math_answer(response: str) -> tuple[bool, str]:
    """(found, the answer) as verl's prime_math cuts it from a response: after the last "answer:" (or
    "answer is", "answers are"), before a following "is the answer" (and kin), the inside of the last
    \\boxed{} (or \\fbox{}) there, up to the last ". ", after the last "is ", "be ", "=", ": ", "get " (and
    kin); found only where a marker or box was and the answer holds a digit."""
    found = False
    for marker in _PRIME_AFTER:
        at = response.lower().rfind(marker)  # as verl: an index of the lower-cased text
        if at != -1:
            found, response = True, response[at + len(marker):].strip()
    for marker in _PRIME_BEFORE:
        at = response.lower().rfind(marker)
        if at != -1:
            found, response = True, response[:at].strip()
    boxed = _prime_boxed(response)
    if boxed:
        found, response = True, boxed
    if ". " in response:
        at = response.lower().rfind(". ")
        if at != -1:
            response = response[:at].strip()
    for marker in _PRIME_LAST_AFTER:
        at = response.lower().rfind(marker)
        if at != -1:
            found, response = True, response[at + len(marker):].strip()
    return found and any(c.isdigit() for c in response), response


def _prime_boxed(text: str) -> str | None:
    """The stripped inside of the last \\boxed (else \\fbox): from the first '{' after it to the '}' that
    brings the braces back to zero; None where there is none."""
    box = _last_box(text)
    return None if box is None else text[text.find("{", box[0]) + 1:box[1]].strip()


def _mathd_normalized(answer: str) -> str:
    """prm800k's MATH normal form: an enclosing \\text{} dropped, then math_normalized; the answer as it
    then is where that raises."""
    answer = answer.strip()
    try:
        enclosed = _PRIME_ENCLOSING_TEXT.search(answer)
        if enclosed is not None:
            answer = enclosed.group("text").strip()
        return math_normalized(answer)
    except Exception:  # noqa: BLE001 - as verl: any failure keeps the answer
        return answer


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_whole(value: Any) -> bool:
    """Within 1e-7 of an integer (False for what cannot be rounded: inf, nan, text)."""
    try:
        return abs(value - int(round(value))) <= 1e-7
    except Exception:  # noqa: BLE001
        return False


def _without_thousands_commas(text: str) -> str:
    """'1,000,000' -> '1000000'; a tuple's commas ('1,2') stay."""
    while True:
        stripped = _PRIME_THOUSANDS.sub(r"\1\3\4", text)
        if stripped == text:
            return text
        text = stripped


def _text_is_whole(text: str) -> bool:
    try:
        return _is_whole(float(_without_thousands_commas(text)))
    except Exception:  # noqa: BLE001
        return False


@functools.cache
def _latex_converter():
    """pylatexenc's LaTeX-to-text converter, made once; its warnings about a model's broken LaTeX quieted
    (they are not the run's)."""
    from pylatexenc.latex2text import LatexNodes2Text

    logging.getLogger("pylatexenc").setLevel(logging.ERROR)
    return LatexNodes2Text()


def _latex_as_text(expr: str) -> str:
    """A LaTeX answer as plain text sympy can read (pylatexenc's latex2text; √, π, ∞, ∪, ·, × spelled out)."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = _latex_converter().latex_to_text(expr)
    for old, new in _PRIME_SYMBOLS:
        expr = expr.replace(old, new)
    return expr.strip()


def _prm800k_normalized(expr: str) -> str:
    """prm800k's normal form: no enclosing \\text{} or braces, dollars, percent signs, units or degrees;
    "or"/"and" as commas; million and kin as powers of ten; LaTeX as text; "7 3/4" as "7+3/4"; lower
    case; integers as integers."""
    enclosed = _PRIME_ENCLOSING_TEXT.search(expr)
    if enclosed is not None:
        expr = enclosed.group("text")
    for old, new in _PRIME_REPLACED:
        expr = expr.replace(old, new)
    for unit in _PRIME_UNITS:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_whole(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        with contextlib.suppress(Exception):
            expr = _latex_as_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number
    expr = expr.lower()
    if _text_is_whole(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_may_try(expr: str) -> bool:
    """prm800k's guard: at most two distinct letters (sqrt and frac aside) and no exponent form sympy may
    hang on."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (len(letters) <= 2 and not any(bad in expr for bad in _PRIME_UNSAFE)
            and not any(bad.search(expr) for bad in _PRIME_UNSAFE_POWERS))


@contextlib.contextmanager
def _time_limit(seconds: float):
    """TimeoutError after `seconds` of wall time, where this is a process's main thread with no timer of its
    own running (a reward's child process is); elsewhere no limit (the reward's own timeout remains)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0)):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"over {seconds:g} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _sympy_equal(truth: str, given: str) -> bool:
    """sympy simplifies (truth)-(given) to 0, within 10 s; False where the guard refuses or sympy fails."""
    expr = f"({truth})-({given})"
    if not _sympy_may_try(expr):
        return False
    try:
        import sympy
        from sympy.parsing import sympy_parser

        with _time_limit(_PRIME_SYMPY_S):
            transformations = sympy_parser.standard_transformations + (
                sympy_parser.implicit_multiplication_application,)
            return sympy.simplify(_sympy_parsed(expr.replace("^", "**"), transformations)) == 0
    except Exception:  # noqa: BLE001 - as verl: a parse error, sympy's failure or the time limit is "not equal"
        return False


def _tuple_parts(expr: str) -> list[str]:
    """A tuple or interval's elements ('(1, 2]' -> ['1', '2']), or [expr]; [] for an empty text."""
    expr = _without_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in "()[]" and expr[-1] in "()[]" and not any(c in expr[1:-1] for c in "()[]"):
        return [part.strip() for part in expr[1:-1].split(",")]
    return [expr]


def prm800k_equal(given: str, truth: str) -> bool:
    """prm800k's grade_answer: equal in MATH normal form, or in prm800k's; else, element by element of a
    tuple (same brackets), fractions as written, an integer only as an integer, anything else where sympy
    simplifies the difference to 0."""
    if _mathd_normalized(truth) == _mathd_normalized(given):
        return True
    truth, given = _prm800k_normalized(truth), _prm800k_normalized(given)
    if truth == given:
        return True
    if not given:
        return False
    truth_parts, given_parts = _tuple_parts(truth), _tuple_parts(given)
    if len(truth_parts) != len(given_parts) or \
            (len(truth_parts) > 1 and (truth[0], truth[-1]) != (given[0], given[-1])):
        return False
    for truth_part, given_part in zip(truth_parts, given_parts):
        if _PRIME_FRACTION.search(truth_part) and _PRIME_FRACTION.search(given_part):
            equal = truth_part == given_part  # an unreduced fraction is not the answer
        elif _text_is_whole(truth_part) != _text_is_whole(given_part):
            equal = False
        else:
            equal = _sympy_equal(truth_part, given_part)
        if not equal:
            return False
    return True


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
               ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
               ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_}
_COMPARISONS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
                ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
                ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_CONTAINERS = {ast.List: list, ast.Tuple: tuple, ast.Set: set}
_LARGEST_BITS = 4 * 10 ** 6  # of an integer worked out (a power, product or shift): beyond, eval would hang
_LARGEST_ITEMS = 10 ** 7  # of a repeated text or list


def _python_value(text: str) -> Any:
    """What Python's eval makes of a text of literals, arithmetic, comparisons, brackets and indexing ('2*3.14'
    -> 6.28, '[1, 2]' -> [1, 2]); ValueError for anything else (names, calls, attributes: a model's code is
    never run) and for results too large to work out."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, MemoryError, RecursionError) as err:
        raise ValueError(f"not a Python value: {err}") from None
    return _value_of(tree)


def _too_large(op: ast.operator, left: Any, right: Any) -> bool:
    """A power, product, shift, repetition or text formatting eval would spend minutes or gigabytes on."""
    whole = isinstance(left, int) and isinstance(right, int)
    sequence = (str, bytes, list, tuple)
    if isinstance(op, ast.Pow):
        return whole and abs(left) > 1 and right > 0 and left.bit_length() * right > _LARGEST_BITS
    if isinstance(op, ast.LShift):
        return whole and left != 0 and left.bit_length() + right > _LARGEST_BITS
    if isinstance(op, ast.Mult):
        if whole:
            return left.bit_length() + right.bit_length() > _LARGEST_BITS
        return ((isinstance(left, sequence) and isinstance(right, int) and len(left) * right > _LARGEST_ITEMS)
                or (isinstance(right, sequence) and isinstance(left, int) and len(right) * left > _LARGEST_ITEMS))
    return isinstance(op, ast.Mod) and isinstance(left, (str, bytes))  # '%0999999999d' % 0: a gigabyte


def _value_of(node: ast.AST) -> Any:
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        chain = []  # '1+2+3+...' nests to the left: worked along it, not by recursion (as long as eval takes)
        while isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            chain.append(node)
            node = node.left
        value = _value_of(node)
        for link in reversed(chain):
            right = _value_of(link.right)
            if _too_large(link.op, value, right):
                raise ValueError("too large to work out")
            value = _ARITHMETIC[type(link.op)](value, right)
        return value
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, tuple(_CONTAINERS)):
        return _CONTAINERS[type(node)](_value_of(item) for item in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value_of(key): _value_of(value) for key, value in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value_of(node.operand))
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARISONS for op in node.ops):
        left = _value_of(node.left)
        for op, right_node in zip(node.ops, node.comparators):  # chained, stopping at the first false, as Python
            right = _value_of(right_node)
            if not _COMPARISONS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        value = None
        for operand in node.values:  # the deciding operand's value, as Python's and/or
            value = _value_of(operand)
            if bool(value) != isinstance(node.op, ast.And):
                return value
        return value
    if isinstance(node, ast.IfExp):
        return _value_of(node.body) if _value_of(node.test) else _value_of(node.orelse)
    if isinstance(node, ast.Subscript):
        return _value_of(node.value)[_value_of(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if part is None else _value_of(part) for part in (node.lower, node.upper, node.step)))
    raise ValueError(f"not a plain value: {type(node).__name__}")


# What sympy's parse_expr may run of a model's answer: its code (parse_expr turns the text into Python code, then
# evals it) checked first, so only numbers, symbols, arithmetic and these functions run; never a text argument
# but a symbol's or a number's (sympy's functions sympify a text: that runs it).
_SYMPY_FUNCTIONS = frozenset((
    "Symbol", "Integer", "Float", "Rational", "Function", "Matrix", "sqrt", "root", "cbrt", "exp", "log", "ln", "sin",
    "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "Abs", "factorial",
    "binomial", "floor", "ceiling", "frac", "Min", "Max", "min", "max", "gcd", "lcm", "re", "im", "sign", "Mod",
    "conjugate"))
_SYMPY_CONSTANTS = frozenset(("pi", "E", "I", "oo", "zoo", "nan", "EulerGamma", "GoldenRatio", "Catalan"))
_NUMBER_TEXT = re.compile(r"[0-9.eE+\-/ ]+")
# the text a call may take: a symbol's or an undefined function's name, a number's digits
_SYMPY_TEXT_ARGUMENTS = {"Symbol": str.isidentifier, "Function": str.isidentifier,
                         **dict.fromkeys(("Integer", "Float", "Rational"),
                                         lambda text: _NUMBER_TEXT.fullmatch(text) is not None)}
_SYMPY_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.Mod, ast.FloorDiv, ast.USub, ast.UAdd,
                    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@functools.cache
def _sympy_namespace() -> dict:
    """parse_expr's own namespace: sympy's names, Python's built-in functions, max and min as Max and Min."""
    import builtins

    from sympy import Max, Min

    namespace: dict = {}
    exec("from sympy import *", namespace)  # noqa: S102 - a fixed import, as parse_expr builds it
    namespace.update({name: value for name, value in vars(builtins).items()
                      if isinstance(value, types.BuiltinFunctionType)})
    namespace.update(max=Max, min=Min)
    return namespace


def _check_sympy_code(node: ast.AST) -> None:
    """ValueError unless the code is numbers, allowed names, arithmetic, comparisons, brackets and calls of
    _SYMPY_FUNCTIONS (a text only as a symbol's or a number's, an undefined function's name called)."""
    if isinstance(node, ast.Call):
        if node.keywords:
            raise ValueError("keyword arguments")
        function = node.func
        if isinstance(function, ast.Call):  # Function('f')(x): an undefined function
            if not (isinstance(function.func, ast.Name) and function.func.id == "Function"):
                raise ValueError("a called call")
            _check_sympy_code(function)
        elif not (isinstance(function, ast.Name) and function.id in _SYMPY_FUNCTIONS):
            raise ValueError(f"a call of {ast.unparse(function)[:40]}")
        for argument in node.args:
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                readable = _SYMPY_TEXT_ARGUMENTS.get(getattr(function, "id", ""))
                if readable is None or not readable(argument.value):
                    raise ValueError("a text argument")
            else:
                _check_sympy_code(argument)
        return
    if isinstance(node, ast.Name):
        if node.id not in _SYMPY_CONSTANTS:
            raise ValueError(f"the name {node.id[:40]}")
        return
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, complex)) or isinstance(node.value, bool):
            raise ValueError("a constant that is no number")
        return
    if not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.List, ast.Tuple, ast.Load,
                             *_SYMPY_OPERATORS)):
        raise ValueError(f"a {type(node).__name__}")
    for child in ast.iter_child_nodes(node):
        _check_sympy_code(child)


def _sympy_parsed(text: str, transformations: tuple) -> Any:
    """sympy's parse_expr(text, transformations=...), with the code it would run checked first (ValueError for
    code that is not plain: _check_sympy_code)."""
    from sympy.parsing.sympy_parser import eval_expr, stringify_expr

    namespace = dict(_sympy_namespace())
    code = stringify_expr(text, {}, namespace, transformations)
    _check_sympy_code(ast.parse(code, mode="eval"))
    return eval_expr(code, {}, namespace)


def _tora_normalized(answer: Any, pi: float) -> Any:
    """math_equal's first step: '$5' -> '5', '5%' -> '5', a base's subscript dropped ('101_2' -> 101; a
    ValueError where the rest is not a number), \\pi as its value where the text is then arithmetic."""
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:
        return int(float(answer.split("_")[0]))
    if "\\pi" in answer:
        at = answer.find("\\pi")
        while at != -1:
            factor = "*" if at > 0 and answer[at - 1].isdigit() else "1*"
            answer = answer[:at] + f"{factor}{pi}" + answer[at + 3:]
            at = answer.find("\\pi", at + 1)
        with contextlib.suppress(Exception):
            answer = _python_value(answer)
    return answer


def _tora_number(value: Any) -> tuple[bool, float | None]:
    """(True, the number) where the value's text is a float with its commas (or '{,}'s) out."""
    try:
        text = str(value)
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _interval_as_brackets(text: str) -> str:
    """sympy's Interval(a, b) as [a, b] (Ropen as [a, b), Lopen as (a, b], open as (a, b))."""
    for name, left, right in (("Interval", "[", "]"), ("Interval.Ropen", "[", ")"), ("Interval.Lopen", "(", "]"),
                              ("Interval.open", "(", ")")):
        inside = re.match(f"^{re.escape(name)}\\((.*)\\)$", text)
        if inside:
            return left + inside.group(1) + right
    return text


def tora_equal(prediction: Any, reference: Any, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """ToRA's math_equal as verl's prime_math runs it: equal as text (case and spaces aside); as numbers
    (within `tolerance`, the reference also as a percentage); with brackets and braces aside; part by part
    of an interval, a comma list, a Point or a pmatrix. Its symbolic step never runs in verl (its time limit
    is a decorator used as a context manager: the TypeError is caught as a failure), so not here either.
    Raises where verl's raises (the caller scores that 0)."""
    prediction, reference = _tora_normalized(prediction, pi), _tora_normalized(reference, pi)
    if isinstance(prediction, str) and len(prediction) > _PRIME_MAX_CHARS:
        prediction = prediction[:_PRIME_MAX_CHARS]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower() or \
                prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    said, truth = _tora_number(prediction), _tora_number(reference)
    if said[0] and truth[0]:
        candidates = [truth[1] / 100, truth[1], truth[1] * 100] if include_percentage else [truth[1]]
        return any(math.isclose(candidate, said[1], rel_tol=tolerance) for candidate in candidates)
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), _interval_as_brackets(str(prediction).strip())

    def parts_equal(said_parts, true_parts) -> bool:  # every pair compared (a raise in any counts), as verl
        return all([tora_equal(s, t, include_percentage, tolerance) for s, t in zip(said_parts, true_parts)])

    said_bare, true_bare = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or \
            (prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        said_bare, true_bare = said_bare.strip("[]()"), true_bare.strip("[]()")
    for bracket in "{}()":
        said_bare, true_bare = said_bare.replace(bracket, ""), true_bare.replace(bracket, "")
    if said_bare == true_bare:
        return True
    if prediction and reference and prediction[0] in "([" and prediction[-1] in ")]" and \
            (prediction[0], prediction[-1]) == (reference[0], reference[-1]):
        said_parts, true_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(said_parts) == len(true_parts) and parts_equal(said_parts, true_parts):
            return True
    if "," in prediction and "," in reference:
        said_parts = [part.strip() for part in prediction.split(",")]
        true_parts = [part.strip() for part in reference.split(",")]
        if len(said_parts) == len(true_parts):
            return parts_equal(said_parts, true_parts)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        said_parts, true_parts = prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(",")
        if len(said_parts) == len(true_parts) and parts_equal(said_parts, true_parts):
            return True
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        with contextlib.suppress(Exception), _time_limit(_PRIME_SYMPY_S):
            from sympy.parsing.sympy_parser import standard_transformations

            said_matrix = _sympy_parsed(prediction, standard_transformations)
            true_items = reference.split()[1:-1:2]
            if len(said_matrix) == len(true_items) and parts_equal(said_matrix, true_items):
                return True
    elif r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(_python_value(prediction), list):
            with contextlib.suppress(Exception):
                said_matrix = _python_value(prediction)
                rows = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                        .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}").split("\\"))
                true_rows = [row.split("&") if "&" in row else row for row in rows]
                if len(said_matrix) == len(true_rows) and parts_equal(said_matrix, true_rows):
                    return True
    return False


def prime_math_score(model_output: Any, ground_truth: Any) -> tuple[bool, bool, str]:
    """verl's prime_math.compute_score: (correct, formatted, the answer read). Correct where prm800k_equal
    says so, else where tora_equal does (a \\pi answer with \\pi as 3.14159... or as 3.14); formatted where
    the output has "Step 2:" and a box (True wherever prm800k_equal says correct)."""
    model_output, ground_truth = str(model_output), str(ground_truth)
    _, answer = prime_math_answer(model_output)
    if prm800k_equal(answer, ground_truth):
        return True, True, answer
    formatted = "Step 2:" in model_output and "\\box" in model_output
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            correct = any([tora_equal(answer, ground_truth, pi=pi) for pi in _PRIME_PI_VALUES])
        else:
            correct = tora_equal(answer, ground_truth)
    except Exception:  # noqa: BLE001 - as verl: an answer math_equal cannot read is wrong
        correct = False
    return correct, formatted, answer


def prime_math_reward(solution_str: str, ground_truth: Any) -> float:
    """verl's rule for numina_* rows (PRIME's Eurus-2-RL-Data): 1.0 where prime_math_score says correct."""
    return float(prime_math_score(solution_str, ground_truth)[0])


# ---------------------------------------------------------------- by data_source
_RULES = {"openai/gsm8k": gsm8k_reward,
          **dict.fromkeys(("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"),
                          hendrycks_math_reward),
          **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), math_dapo_reward),
          **dict.fromkeys([f"searchR1_{name}" for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                                           "musique", "bamboogle")], search_r1_reward),
          **dict.fromkeys(("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                           "numina_cn_k12", "numina_olympiads"), prime_math_reward),
          **dict.fromkeys(CODE_SOURCES, prime_code_reward)}
_NEEDS_VERL = {"hiyouga/geometry3k": "geo3k (mathruler; its rows are images, which etarl does not take)"}
WITH_VERL = "rollout.reward=verl.utils.reward_score:default_compute_score with verl installed on every node"


def _rule(data_source: str):
    rule = _RULES.get(data_source)
    if rule is None and isinstance(data_source, str) and data_source.startswith("aime"):
        rule = math_dapo_reward
    return rule


def why_unscorable(data_source: Any) -> str | None:
    """Why rollout.reward=verl cannot score a data_source; None when it can."""
    if _rule(data_source) is not None:
        return None
    if data_source in _NEEDS_VERL:
        return f"verl scores it with {_NEEDS_VERL[data_source]}, which etarl does not carry: set {WITH_VERL}"
    if not data_source:
        return "rows without a data_source: verl's default reward goes by it (rollout.task.data_source_key)"
    return "verl's default reward has no rule for it either: set rollout.reward to a function that scores it"


def _why_bad_reference(data_source: Any, ground_truth: Any) -> str | None:
    """Why a row's ground_truth cannot be scored by its data_source's rule (verl's rules compare text,
    Search-R1's a {'target': answers} map); None when it can."""
    if _rule(data_source) is search_r1_reward:
        targets = ground_truth.get("target") if isinstance(ground_truth, dict) else None
        if isinstance(targets, str) or (isinstance(targets, list) and targets
                                        and all(isinstance(t, str) for t in targets)):
            return None
        return "its ground_truth is not {'target': [answers]} (so it never scores)"
    if _rule(data_source) is prime_code_reward:
        return why_bad_tests(ground_truth)
    if _rule(data_source) is prime_math_reward and isinstance(ground_truth, (int, float)) \
            and not isinstance(ground_truth, bool):
        return None  # prime_math reads str(ground_truth), as verl's
    if not isinstance(ground_truth, str):
        kind = ("missing" if ground_truth is None else "a number" if isinstance(ground_truth, (int, float))
                else "a list" if isinstance(ground_truth, list) else "a map" if isinstance(ground_truth, dict)
                else f"a {type(ground_truth).__name__}")
        return f"its ground_truth is {kind}, not text (verl compares text: it never scores)"
    return None


def why_unscorable_row(data_source: Any, ground_truth: Any) -> str | None:
    """Why rollout.reward=verl cannot score a row (a data_source without a rule here, or a reference its rule
    cannot read), as a bad row says it; None when it can."""
    why = why_unscorable(data_source) or _why_bad_reference(data_source, ground_truth)
    return None if why is None else f"rollout.reward=verl cannot score it: data_source {data_source!r}: {why}"


def verl_default_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
    """verl's default_compute_score for the data sources above: a float, or math_dapo's dict."""
    rule = _rule(data_source)
    if rule is None:
        raise ValueError(f"rollout.reward=verl cannot score data_source {data_source!r}: "
                         f"{why_unscorable(data_source)}")
    scored = rule(solution_str, ground_truth)
    return scored if isinstance(scored, dict) else float(scored)
