"""verl's default reward without verl: `rollout.reward=verl` scores each row by its data_source with the
rule `verl.utils.reward_score.default_compute_score` uses for it, so a verl user's GSM8K, MATH, DAPO/AIME
and Search-R1 files score in etarl as they score in verl:

  openai/gsm8k                                    gsm8k_reward: the number after the last '#### '
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                                  hendrycks_math_reward: the last \\boxed{},
                                                  equal after the MATH normalisation; 1.0 or 0.0
  math_dapo, math, math_dapo_reasoning, aime*     math_dapo: "Answer: ..." (else the last \\boxed{}, as
                                                  verl since August 2026, #7407) in the last 300
                                                  characters; {score: 1.0 or -1.0, acc}
  searchR1_nq, searchR1_triviaqa, ...             search_r1: the last <answer>...</answer>, an exact
                                                  match of ground_truth["target"] after normalising

The rules are written from verl's behaviour (verl 1dda039) and checked against verl's functions on
random texts. verl's other rules need packages etarl does not carry (sympy for prime_math, a sandbox
for code, mathruler for geometry3k): their rows, and rows of a data_source verl has no rule for, are
bad rows (`why_unscorable_row`, with rows whose reference their rule cannot read: refused when a run
starts, or skipped with rollout.task.skip_invalid), and fail as a reward error if one reaches a worker.
In a multi-turn tools run the rule reads the answer turn, where verl reads the whole response (a
Search-R1 answer in an earlier turn, or its tag count, differ there).
"""
from __future__ import annotations

import re
import string
from typing import Any

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
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = _closing_brace(text, start)
    return None if end is None else text[start:end + 1]


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


# ---------------------------------------------------------------- by data_source
_RULES = {"openai/gsm8k": gsm8k_reward,
          **dict.fromkeys(("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"),
                          hendrycks_math_reward),
          **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), math_dapo_reward),
          **dict.fromkeys([f"searchR1_{name}" for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                                           "musique", "bamboogle")], search_r1_reward)}
_NEEDS_VERL = {**dict.fromkeys(("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                                "numina_cn_k12", "numina_olympiads"), "prime_math (sympy, pylatexenc)"),
               **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), "prime_code or a Sandbox Fusion server"),
               "hiyouga/geometry3k": "geo3k (mathruler; its rows are images, which etarl does not take)"}
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
