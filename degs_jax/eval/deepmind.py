"""DeepMind500 answers: the rules that grade an answer to a DeepMind mathematics question.

The benchmark's gold answers are strings of DeepMind's ``mathematics_dataset`` in Python
syntax (``-13402348*w**2``, ``True``, ``7:01 PM``, ``2911, 5, 0.5, -53``, ``a660``); a
boxed answer is LaTeX. math-verify (the MATH500 grader) compares most of them well once
``**`` is ``^``, but misses whole kinds of right answers and accepts some wrong ones. The
rules below, tried in this order, each decide an answer alone (no fall-through):

1. **Yes/no questions** (gold ``True``/``False``: ``Does 1230 divide 22481102?``, ``Is
   873578389 composite?``, ``Is -5462 less than or equal to -5130?``). ``yes``/``true``
   mean True and ``no``/``false`` False, with or without ``\\text{}`` and case. Where the
   question asks whether something is prime or composite, naming the property also answers
   it: ``composite`` to ``Is 873578389 composite?`` is yes, ``prime`` is no (``not prime``
   and ``a composite number`` likewise). Any other text is wrong.
2. **Clock times** (gold ``H:MM AM``/``PM``, ``measurement__time``): the answer is read as
   a time, ``\\text{}``, ``\\,`` and spaces removed (``7:01 \\text{ PM}``, ``7:01PM``,
   ``7:01 p.m.``); without AM/PM it is read on the 24-hour clock (``19:01`` is 7:01 PM,
   ``7:01`` is 7:01 AM). Equal minutes after midnight is right.
3. **Numbers in another base** (the question names ``base N``; ``numbers__base_conversion``,
   ``arithmetic__add_or_sub_in_base``): the digits are compared as text, case-insensitive,
   after removing a subscript of the asked base (``-66174_8``, ``A660_{12}``). math-verify
   would read ``a660`` as the product a·660 and accept ``660a``.
4. **Sorting** (a question that says ``Sort ...`` or ``Put ... in ... order``,
   ``comparison__sort``): the answer's comma-separated items (brackets around the list and
   ``\\text{and}`` before the last item allowed) must equal the gold's *in order*, item by
   item (math-verify per item, so ``-5/2`` equals ``-\\frac{5}{2}``). A question that
   names no direction (``Sort -5, -984, 4, 13, 8.``) also accepts the reverse order. math-
   verify alone compares comma lists as sets, so an ascending list passed a "decreasing
   order" question.
5. **Multiple choice** (the question lists options ``(a) ... (b) ...`` and the gold is a
   letter): the letter (``c``, ``(c)``, ``\\text{c}``), or the content of that option and of
   no other (``5`` for ``(e) 5``).
6. Everything else: math-verify, gold first (as MATH500), the gold and the answer each read
   in the notation of the question: Python syntax (``-2*t**2 + 3239*t - 6``,
   ``15*sqrt(11)/14``, ``x**(-2)``) is rewritten into the LaTeX math-verify reads
   (:func:`to_latex`: ``**`` as ``^{...}``, ``sqrt(...)`` as ``\\sqrt{...}``), so an
   answer boxed in the question's Python syntax and one written in LaTeX are compared by
   their value alike. (math-verify's parser drops ``**``: ``-6*h**2`` parsed as ``-6``.)

Left as math-verify does it: a gold that names a variable of the question (``l`` in
"What is the third smallest value in l, s, d?", where ``Let l = 1.2 + -0.2``) is not
matched by its value (``1.0``), since that needs the question solved; and an answer to
"Factor ...", "Expand ...", "Collect ..." or "Simplify ..." is judged by its value, not its
form (the question's own expression, restated, equals the gold). No answer stored in the
committed studies was judged right in the wrong form.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

# math-verify's own parse/verify timeouts (signal based, in the grading worker).
VERIFY_TIMEOUT_S = 5

_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|~|\$")
_GOLD_TIME = re.compile(r"^(\d{1,2}):(\d{2}) ([AP])M$")
_TIME = re.compile(r"^(\d{1,2}):(\d{2})(?:([ap])\.?m\.?)?$")
_PROPERTY = re.compile(r"\b(prime|composite)\b")
_PROPERTY_ANSWER = re.compile(r"^(?:it is |is )?(not )?(?:an? )?(prime|composite)(?: number)?$")
_BASE = re.compile(r"\bbase (\d+)\b")
_SORT = re.compile(r"(?:^|[.?!]\s+)(?:Sort|Put)\s")
_DIRECTION = re.compile(r"\b(?:increasing|decreasing|ascending|descending) order\b")
_OPTION = re.compile(r"\(([a-z])\)\s")
_LIST_BRACKETS = (("\\left(", "\\right)"), ("\\left[", "\\right]"), ("(", ")"), ("[", "]"),
                  ("\\{", "\\}"))
_LAST_AND = re.compile(r"^(?:and|or)\s+")


def grade_answer(question: str, gold: str, pred: str) -> bool:
    """Whether the boxed content ``pred`` answers ``question``, whose DeepMind gold answer is
    ``gold`` (module docstring: the rules, in order). Runs in the grading worker
    (math-verify through :func:`math_equal`)."""
    equal = math_equal
    gold = gold.strip()
    if gold in ("True", "False"):
        return yes_no(question, pred) == (gold == "True")
    if _GOLD_TIME.match(gold):
        return clock_minutes(gold) == clock_minutes(pred)
    base = _BASE.findall(question)
    if base:
        return same_digits(gold, pred, base[-1])
    if _SORT.search(question):
        return same_order(gold, pred, equal, either_direction=not _DIRECTION.search(question))
    options = choices(question)
    if len(gold) == 1 and gold in options:
        return chosen_option(pred, gold, options, equal)
    return equal(to_latex(gold), to_latex(pred))


_POWER = re.compile(r"\*\*\s*")
_SQRT = re.compile(r"(?<![\\\w])sqrt\s*\(")
# an exponent without parentheses: a number, a name or a LaTeX command, with the powers
# already rewritten after it (``a**b**c`` is ``a**(b**c)``, rewritten from the right)
_POWER_ATOM = re.compile(r"-?(?:[\w.]+|\\[A-Za-z]+)(?:\^\{[^{}]*\})*")


def _closing(text: str, open_at: int) -> int:
    """The index of the parenthesis closing the one at ``open_at`` (-1: unbalanced)."""
    depth = 0
    for k in range(open_at, len(text)):
        depth += (text[k] == "(") - (text[k] == ")")
        if depth == 0:
            return k
    return -1


def to_latex(text: str) -> str:
    """``text`` with the Python syntax of DeepMind's questions and golds rewritten into the
    LaTeX math-verify reads: ``a**b`` and ``a**(b)`` as ``a^{b}``, ``sqrt(x)`` as
    ``\\sqrt{x}`` (nested alike); ``*``, ``/`` and the rest read the same in both. LaTeX is
    left as it is (it has no ``**``, and ``\\sqrt`` is not ``sqrt(``); an unbalanced
    parenthesis is left unrewritten."""
    while (m := _SQRT.search(text)) is not None:
        close = _closing(text, m.end() - 1)
        if close < 0:
            break
        text = text[:m.start()] + "\\sqrt{" + text[m.end():close] + "}" + text[close + 1:]
    while (powers := list(_POWER.finditer(text))):
        m = powers[-1]  # the last first: powers are right-associative
        rest = m.end()
        if text.startswith("(", rest) and (close := _closing(text, rest)) >= 0:
            exponent, end = text[rest + 1:close], close + 1
        elif (atom := _POWER_ATOM.match(text, rest)) is not None:
            exponent, end = atom.group(0), atom.end()
        else:
            exponent, end = "", rest
        text = text[:m.start()] + "^{" + exponent + "}" + text[end:]
    return text


_VARIABLE = re.compile(r"(?<![\\\\A-Za-z])[A-Za-z]")


def math_equal(gold: str, pred: str) -> bool:
    """math-verify, gold first, each string read as the content of a ``\\boxed{}``. A gold
    written in variables (a letter outside a LaTeX command: ``3*l``, ``4590*t``) is also
    compared with math-verify's unit removal off: by default it drops a trailing letter
    that names a unit, reading ``3l`` or ``3 l`` as 3 and ``4590t`` as 4590 (litres and
    tonnes), so the right answer to "Collect the terms in 2*l + l" failed. The second
    comparison only reads answers more literally, so it can only make a verdict right
    where the answer equals the gold as written."""
    from math_verify import parse, verify  # math-verify and sympy: in the grading worker only

    def equal(extraction_config=None) -> bool:
        options = {} if extraction_config is None else {"extraction_config": extraction_config}
        gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=VERIFY_TIMEOUT_S, **options)
        pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=VERIFY_TIMEOUT_S, **options)
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=VERIFY_TIMEOUT_S))

    return equal() or (_VARIABLE.search(gold) is not None and equal(_literal_extraction()))


def _literal_extraction() -> list:
    """math-verify's default extraction (LaTeX, then plain expressions) without unit removal."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig  # (as above: the grading worker only)

    latex = LatexExtractionConfig()
    return [dataclasses.replace(latex, normalization_config=dataclasses.replace(
        latex.normalization_config, units=False)), ExprExtractionConfig()]


def plain_text(text: str) -> str:
    """``text`` without ``\\text{...}``-style wrappers (their content kept), LaTeX spacing
    and dollar signs, with runs of spaces collapsed and outer spaces and a final period
    removed."""
    while (unwrapped := _TEXT.sub(r"\1", text)) != text:
        text = unwrapped
    text = _SPACING.sub(" ", text)
    return " ".join(text.split()).strip().rstrip(".").strip()


def yes_no(question: str, pred: str) -> Optional[bool]:
    """The yes/no answer ``pred`` gives to ``question``, or None if it gives none."""
    word = plain_text(pred).lower()
    if word in ("yes", "true"):
        return True
    if word in ("no", "false"):
        return False
    asked = _PROPERTY.findall(question.lower())
    named = _PROPERTY_ANSWER.match(word)
    if len(set(asked)) == 1 and named:
        return (named.group(2) == asked[0]) != bool(named.group(1))
    return None


def clock_minutes(text: str) -> Optional[int]:
    """Minutes after midnight of a clock time (``7:01 PM``, ``7:01 \\text{ PM}``, ``19:01``),
    or None if ``text`` is not one. Without AM/PM the 24-hour clock."""
    m = _TIME.match(plain_text(text).replace(" ", "").lower())
    if m is None:
        return None
    hour, minute, half = int(m.group(1)), int(m.group(2)), m.group(3)
    if minute > 59 or (half and not 1 <= hour <= 12) or hour > 23:
        return None
    if half:
        hour = hour % 12 + (12 if half == "p" else 0)
    return 60 * hour + minute


def same_digits(gold: str, pred: str, base: str) -> bool:
    """Whether ``pred`` writes the number ``gold`` (digits of base ``base``, letters for digits
    above 9): compared as text, case-insensitive, after removing a subscript ``_{base}``."""
    text = plain_text(pred).replace(" ", "")
    text = re.sub(r"_\{?" + base + r"\}?$", "", text)
    text = re.sub(r"\(base" + base + r"\)$", "", text)
    return text.lower() == gold.replace(" ", "").lower()


def split_items(text: str) -> list[str]:
    """The top-level comma-separated items of a list (commas inside braces, brackets or
    parentheses do not split)."""
    items, depth, start = [], 0, 0
    for k, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:k])
            start = k + 1
    items.append(text[start:])
    return [item.strip() for item in items]


def answer_items(pred: str) -> list[str]:
    """The items of a list answer: brackets around the whole list removed, and ``and``/``or``
    (in ``\\text{}`` or not) before the last item."""
    text = plain_text(pred)
    for left, right in _LIST_BRACKETS:
        if text.startswith(left) and text.endswith(right) and len(split_items(text)) == 1:
            inner = text[len(left):len(text) - len(right)].strip()
            if len(split_items(inner)) > 1:
                text = inner
            break
    items = split_items(text)
    items[-1] = _LAST_AND.sub("", items[-1])
    return items


def same_order(gold: str, pred: str, equal: Callable[[str, str], bool],
               either_direction: bool = False) -> bool:
    """Whether the list answer ``pred`` has the gold's items in the gold's order (or, with
    ``either_direction``, in the reverse order), item by item by ``equal``."""
    want = [to_latex(item) for item in split_items(gold)]
    got = [to_latex(item) for item in answer_items(pred)]
    if len(got) != len(want) or not all(got):
        return False
    orders = [want, want[::-1]] if either_direction else [want]
    return any(all(equal(w, g) for w, g in zip(order, got)) for order in orders)


def choices(question: str) -> dict[str, str]:
    """The options ``(a) ... (b) ...`` of a multiple-choice question, letter -> content
    (empty unless the letters run a, b, c, ... from a)."""
    marks = list(_OPTION.finditer(question))
    if not marks or [m.group(1) for m in marks] != [chr(ord("a") + k) for k in range(len(marks))]:
        return {}
    ends = [m.start() for m in marks[1:]] + [len(question)]
    return {m.group(1): question[m.end():end].strip().rstrip("?.").strip()
            for m, end in zip(marks, ends)}


def chosen_option(pred: str, gold: str, options: dict[str, str],
                  equal: Callable[[str, str], bool]) -> bool:
    """Whether ``pred`` picks option ``gold``: its letter, or a value equal to that option's
    content and to no other option's."""
    letter = plain_text(pred).strip("() ").lower()
    if letter in options:
        return letter == gold
    matches = [k for k, content in options.items() if equal(to_latex(content), to_latex(pred))]
    return matches == [gold]
