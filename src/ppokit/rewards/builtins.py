"""Built-in reward functions, each fn(prompts, completions, **columns) -> list[float].

Those with parameters are dataclasses: a config entry `{function: regex, pattern: "..."}` is
built with the config machinery (unknown keys and out-of-range values are errors naming the
key), and the same class is usable from Python: `Regex(pattern="...")`. Model output is only
ever matched and parsed, never evaluated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional

from ppokit.config.schema import non_negative, positive
from ppokit.config.fields import doc, one_of
from ppokit.errors import UserError

# --------------------------------------------------------------------------- sentiment


def sentiment(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """VADER compound sentiment of each completion, in [-1, 1] (vaderSentiment ships its lexicon)."""
    return [_vader().polarity_scores(text)["compound"] for text in completions]


_VADER = None


def _vader():
    global _VADER
    if _VADER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _VADER = SentimentIntensityAnalyzer()
    return _VADER


# --------------------------------------------------------------------------- answers

# A number as written in answers: sign, thousands separators, decimals, exponent.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
_FRACTION_RE = re.compile(rf"^({_NUMBER})/({_NUMBER})$")
_LATEX_FRACTION_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_NUMBER_IN_TEXT_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|[-+]?\.\d+")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def after_hashes(text: str) -> Optional[str]:
    """The rest of the line after the last `####` (GSM8K's answer marker); None if there is none."""
    at = text.rfind("####")
    if at < 0:
        return None
    rest = text[at + 4 :].strip()
    return rest.splitlines()[0].strip() if rest else ""


def last_number(text: str) -> Optional[str]:
    found = _NUMBER_IN_TEXT_RE.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, how: str, fallback: str) -> Optional[str]:
    """The answer part of `text`: `auto` tries \\boxed{}, then `####`, then `fallback` (last_number or none)."""
    if how == "boxed":
        return last_boxed(text)
    if how == "hash":
        return after_hashes(text)
    if how == "last_number":
        return last_number(text)
    if how == "none":
        return text.strip()
    for found in (last_boxed(text), after_hashes(text)):
        if found is not None:
            return found
    return extract_answer(text, fallback, fallback)


def _strip_latex(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}", r"\1", text)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\%", "%", "\\$", "^\\circ", "^{\\circ}"):
        text = text.replace(token, "")
    return text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip().rstrip(".").strip()


def parse_number(text: str) -> Optional[Fraction]:
    """`1,234.5`, `-3/4`, `\\frac{3}{4}`, `50%`, `$12` -> an exact Fraction; anything else -> None."""
    text = _strip_latex(text).replace(" ", "")
    if not text:
        return None
    latex = _LATEX_FRACTION_RE.match(text)
    if latex:
        num, den = parse_number(latex.group(2)), parse_number(latex.group(3))
        if num is None or not den:
            return None
        return (-1 if latex.group(1) else 1) * num / den
    frac = _FRACTION_RE.match(text)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return num / den if num is not None and den else None
    if _NUMBER_RE.match(text) and any(c.isdigit() for c in text):
        try:
            return Fraction(text.replace(",", ""))
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _normalise_text(text: str, case_sensitive: bool) -> str:
    text = " ".join(_strip_latex(text).split())
    return text if case_sensitive else text.lower()


def _answers(columns: dict, column: str, name: str) -> list[Any]:
    if column not in columns:
        raise UserError(
            f"{name}: the data has no column {column!r} with the reference answers "
            f"(columns: {', '.join(sorted(columns)) or 'none'}); set answer_column"
        )
    return columns[column]


@dataclass
class ExactMatch:
    """`on_correct` when the completion's answer equals the reference answer, else `on_wrong`.

    Both sides are normalised (LaTeX wrappers, `$`, `%`, trailing period, spacing, case); when
    both parse as numbers they are compared as numbers (`1,000` = `1000.0`).
    """

    answer_column: str = doc("answer", "Column of the data with the reference answer (it may hold a full solution: its \\boxed{} or `####` part is taken).")
    extract: str = doc("auto", "Where the completion's answer is: `auto` (\\boxed{}, else after `####`, else the whole completion), `boxed`, `hash`, "
                               "`last_number` or `none` (the whole completion).", check=one_of(("auto", "boxed", "hash", "last_number", "none")))
    case_sensitive: bool = doc(False, "Compare letters with their case.")
    on_correct: float = doc(1.0, "Score of a correct answer.")
    on_wrong: float = doc(0.0, "Score of a wrong or missing answer.")

    name = "exact_match"
    _fallback = "none"

    def required_columns(self) -> set[str]:
        return {self.answer_column}

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        answers = _answers(columns, self.answer_column, self.name)
        return [self.on_correct if self.is_correct(c, a) else self.on_wrong for c, a in zip(completions, answers)]

    def is_correct(self, completion: str, reference: Any) -> bool:
        found = extract_answer(completion, self.extract, self._fallback)
        if found is None or reference is None:
            return False
        reference = extract_answer(str(reference), "auto", "none")
        return self.equal(found, reference)

    def equal(self, a: str, b: str) -> bool:
        x, y = parse_number(a), parse_number(b)
        if x is not None and y is not None:
            return x == y
        return _normalise_text(a, self.case_sensitive) == _normalise_text(b, self.case_sensitive)


@dataclass
class MathEquivalence(ExactMatch):
    """Like exact_match, but the answer defaults to the last number in the completion and numbers
    match within a tolerance: `0.5` = `1/2` = `\\frac{1}{2}` (a `%` sign is dropped: `50%` reads as 50)."""

    extract: str = doc("auto", "Where the completion's answer is: `auto` (\\boxed{}, else after `####`, else the last number), `boxed`, `hash`, `last_number` "
                               "or `none`.", check=one_of(("auto", "boxed", "hash", "last_number", "none")))
    tolerance: float = doc(1e-6, "Relative tolerance of a numeric match (absolute below 1).", check=non_negative)

    name = "math_equivalence"
    _fallback = "last_number"

    def equal(self, a: str, b: str) -> bool:
        x, y = parse_number(a), parse_number(b)
        if x is not None and y is not None:
            return x == y or math.isclose(float(x), float(y), rel_tol=self.tolerance, abs_tol=self.tolerance)
        return _normalise_text(a, self.case_sensitive) == _normalise_text(b, self.case_sensitive)


@dataclass
class ReasoningGym:
    """The score of reasoning-gym's own `score_answer` (0 to 1) for rows of a `reasoning_gym:` data source: the dataset
    each row names (its `dataset` column) is rebuilt once and scores the completion's answer against the row's entry
    (`answer`, `metadata`; the prompt as its `question`). In a composite the entry's task scores it, as reasoning-gym's
    composite does."""

    extract: str = doc("answer_tag", "Where the completion's answer is: `answer_tag` (the last `<answer>...</answer>`, stripped, as reasoning-gym's prompts "
                                     "ask and its `extract_answer` reads; "
                                     "none found: scored as no answer) or `none` (the whole completion, stripped).", check=one_of(("answer_tag", "none")))

    name = "reasoning_gym"

    def required_columns(self) -> set[str]:
        return {"answer", "metadata", "dataset"}

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        from ppokit.data.reasoning_gym import dataset_for

        missing = sorted(self.required_columns() - set(columns))
        if missing:
            raise UserError(f"{self.name}: scores the rows of a `reasoning_gym:` data source (docs/data.md), which have the columns "
                            f"answer, metadata and dataset; this data has no {', '.join(missing)}")
        answers, metadata, datasets = (columns[c] for c in ("answer", "metadata", "dataset"))
        scores = []
        for prompt, completion, answer, meta, spec in zip(prompts, completions, answers, metadata, datasets):
            entry = {"question": prompt, "answer": answer, "metadata": meta}
            scores.append(float(dataset_for(spec).score_answer(self.answer(completion), entry)))
        return scores

    def answer(self, completion: str) -> Optional[str]:
        if self.extract == "none":
            return completion.strip()
        from reasoning_gym.utils import extract_answer as tagged

        return tagged(completion)


# --------------------------------------------------------------------------- patterns


@dataclass
class Regex:
    """`on_match` when the pattern matches the completion, else `on_no_match`."""

    pattern: Optional[str] = doc(None, "Python regular expression (required).")
    match: str = doc("search", "`search` (anywhere in the completion) or `fullmatch` (the whole completion).", check=one_of(("search", "fullmatch")))
    ignore_case: bool = doc(False, "Match letters regardless of case.")
    dotall: bool = doc(False, "`.` also matches a newline.")
    strip: bool = doc(False, "Strip leading and trailing whitespace before matching.")
    on_match: float = doc(1.0, "Score when the pattern matches.")
    on_no_match: float = doc(0.0, "Score when it does not.")

    name = "regex"

    def check(self, key: str) -> None:
        if not self.pattern:
            raise UserError(f"{key}.pattern: required for {self.name} (a Python regular expression)")
        try:
            self._compiled()
        except re.error as e:
            raise UserError(f"{key}.pattern: {self.pattern!r} is not a valid regular expression: {e}") from None

    def _compiled(self) -> re.Pattern:
        flags = (re.IGNORECASE if self.ignore_case else 0) | (re.DOTALL if self.dotall else 0) | re.MULTILINE
        return re.compile(self.pattern, flags)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        compiled = self._compiled()
        test = compiled.fullmatch if self.match == "fullmatch" else compiled.search
        return [self.on_match if test(c.strip() if self.strip else c) else self.on_no_match for c in completions]


@dataclass
class Format(Regex):
    """A format check: by default the pattern must match the whole (stripped) completion, `.` spanning lines."""

    match: str = doc("fullmatch", "`fullmatch` (the whole completion) or `search` (anywhere).", check=one_of(("search", "fullmatch")))
    dotall: bool = doc(True, "`.` also matches a newline.")
    strip: bool = doc(True, "Strip leading and trailing whitespace before matching.")

    name = "format"


@dataclass
class Contains:
    """Fraction of `required` words present minus fraction of `forbidden` words present, in [-1, 1]."""

    required: list[str] = doc(factory=list, help="Words or phrases the completion should contain.")
    forbidden: list[str] = doc(factory=list, help="Words or phrases it should not contain.")
    case_sensitive: bool = doc(False, "Compare letters with their case.")
    whole_word: bool = doc(True, "Match whole words only (`art` does not count inside `start`).")

    name = "contains"

    def check(self, key: str) -> None:
        if not self.required and not self.forbidden:
            raise UserError(f"{key}: contains needs `required` or `forbidden` words")

    def _present(self, words: list[str], text: str) -> int:
        flags = 0 if self.case_sensitive else re.IGNORECASE
        wrap = (lambda w: rf"(?<!\w){re.escape(w)}(?!\w)") if self.whole_word else re.escape
        return sum(bool(re.search(wrap(w), text, flags)) for w in words)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        scores = []
        for text in completions:
            score = self._present(self.required, text) / len(self.required) if self.required else 0.0
            if self.forbidden:
                score -= self._present(self.forbidden, text) / len(self.forbidden)
            scores.append(score)
        return scores


@dataclass
class Length:
    """Rewards completions near `target` length; d = distance to the target in `unit`s.

    linear: -d / scale;  quadratic: -(d / scale)^2;  gaussian: exp(-(d / scale)^2 / 2), 1 at the target.
    """

    target: Optional[float] = doc(None, "Target length (required).", check=positive)
    unit: str = doc("tokens", "`tokens` (the policy's tokens, "
                              "stop token not counted), `words` (split on whitespace) or `characters`.", check=one_of(("tokens", "words", "characters")))
    shape: str = doc("linear", "`linear`, `quadratic` or `gaussian` (see above).", check=one_of(("linear", "quadratic", "gaussian")))
    scale: Optional[float] = doc(None, "Distance that costs 1 (linear, quadratic) or one standard deviation (gaussian); default the target.", check=positive)
    side: str = doc("both", "`both`, `over` (only longer completions are penalised) or `under` (only shorter).", check=one_of(("both", "over", "under")))

    name = "length"

    def check(self, key: str) -> None:
        if self.target is None:
            raise UserError(f"{key}.target: required for length (the length to aim for, in `unit`s)")

    def __call__(self, prompts: list[str], completions: list[str], completion_ids=None, **columns) -> list[float]:
        if self.unit == "tokens":
            if completion_ids is None:
                raise UserError("length: unit `tokens` needs the policy's token ids, which this caller does not give (a remote server scores text); use unit: "
                                "words")
            lengths = [len(ids) for ids in completion_ids]
        elif self.unit == "words":
            lengths = [len(c.split()) for c in completions]
        else:
            lengths = [len(c) for c in completions]
        scale = self.scale or self.target
        scores = []
        for n in lengths:
            d = n - self.target
            d = max(d, 0.0) if self.side == "over" else max(-d, 0.0) if self.side == "under" else abs(d)
            x = d / scale
            scores.append(-x if self.shape == "linear" else -x * x if self.shape == "quadratic" else math.exp(-0.5 * x * x))
        return scores


# Built-ins by config name: a plain function, or a parameter dataclass whose instances are functions.
BUILTINS: dict[str, Callable | type] = {
    "sentiment": sentiment,
    "exact_match": ExactMatch,
    "math_equivalence": MathEquivalence,
    "regex": Regex,
    "format": Format,
    "length": Length,
    "contains": Contains,
    "reasoning_gym": ReasoningGym,
}
