"""The structural rules of the exact answer comparison (`sao_core.envs.exact` documents them and calls
`structural` from `compare`): degrees, sets of integers (prose, symbols, residue classes), value lists (±,
solution lists, named tuples) and sets of reals (relations, intervals, unions)."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sao_core.envs.exact_values import (
    MATCH,
    MISMATCH,
    UNSETTLED,
    Node,
    Outcome,
    ParseError,
    _as_sets,
    applied_name,
    build,
    clean,
    nodes,
    parse_expression,
    relation_chain,
    relation_side,
    tokenize,
)

#: the whole comparison (`sao_core.envs.exact.compare`), passed in: some rules compare rewritten texts
Compare = Callable[[str, str], Outcome]

# ------------------------------------------------------------------------------------------ structural rules
#
# Forms that the structure above does not read, each settled by a named rule (see `structural`):
# ``degrees``, ``prose-set``, ``congruence-progression``, ``plus-minus``, ``solution-list``,
# ``named-tuple``, ``relation-interval`` (and ``factorial-identity`` inside `expressions`). A rule
# returns None when it does not apply; equal only on an exact proof (the same canonical set, sympy's
# set algebra, the structure rules on the rewritten items); different only on an exact witness (a
# member of one set and not of the other, or a proved different part). Anything else is unsettled.

_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|°|\\degree(?![A-Za-z])")
_MOD = re.compile(r"\\pmod\s*\{\s*(\d+)\s*\}|\\pmod\s*(\d+)"
                  r"|\(\s*(?:\\bmod|\\mod|\\operatorname\{mod\}|mod)\s*\{?\s*(\d+)\s*\}?\s*\)"
                  r"|(?:\\bmod|\\mod|(?<![A-Za-z\\])mod)\s*\{?\s*(\d+)\s*\}?(?!\d)")
_VAR = r"(?:[A-Za-z](?:_\{[A-Za-z0-9]+\}|_[A-Za-z0-9])?|\\(?:alpha|beta|gamma|delta|lambda|mu|nu|theta|xi|rho|sigma|tau|phi|psi|omega)(?![A-Za-z]))"
_PLAIN = re.compile(rf"^{_VAR}$")
_CONN_RE = re.compile(r",\s*(and|or)\s+|,|;|\s+(and|or)\s+|\\(land|wedge|lor|vee)(?![A-Za-z])")
_REL_TOKENS = ("<", ">", "\\leq", "\\geq", "\\ne", "\\lt", "\\gt", "<=", ">=", "!=")
_NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
_EXCEPT = re.compile(r"[,;]?\s*\b(?:excluding|except for|except|other than|but not)\s+(.+)$")


def _prep(text: str) -> str:
    """`clean` plus: ``\\ `` as a space, ``\\pmod{4}``/``(\\text{mod } 4)``/``\\bmod 4`` as ``\\MOD{4}``,
    ``\\mathbb Z``/``ℤ`` as ``\\mathbb{Z}``, ``\\varnothing``/``∅`` as ``\\emptyset``."""
    out = clean(text).replace("\\ ", " ")
    out = out.replace("ℤ", "\\mathbb{Z}").replace("ℕ", "\\mathbb{N}").replace("ℝ", "\\mathbb{R}")
    out = re.sub(r"\\(?:mathbb|Bbb)\s*\{?\s*([A-Z])\s*\}?", r"\\mathbb{\1}", out)
    out = out.replace("\\varnothing", "\\emptyset").replace("∅", "\\emptyset")
    out = _MOD.sub(lambda m: " \\MOD{" + next(g for g in m.groups() if g) + "} ", out)
    return re.sub(r"\s+", " ", out).strip()


def _wordy(text: str) -> bool:
    """Words (three or more letters outside LaTeX commands, other than and/or) in the answer: prose."""
    plain = re.sub(r"\\[A-Za-z]+", " ", _prep(text))
    return any(w.group(0).lower() not in ("and", "or")
               for w in re.finditer(r"(?<![A-Za-z])[A-Za-z]{3,}", plain))


def _split_top_level(text: str, separator_at: Callable[[str, int], tuple[int, str] | None]) -> list[tuple[str, str]]:
    """The parts of `text` between the separators outside brackets, each with the label of the separator before
    it (``""`` for the first). `separator_at(text, i)` says whether a separator starts at index `i`: None, or
    ``(index just past it, its label)``."""
    out: list[tuple[str, str]] = []
    depth, start, label, i = 0, 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            found = separator_at(text, i)
            if found is not None:
                out.append((label, text[start:i].strip()))
                i = start = found[0]
                label = found[1]
                continue
        i += 1
    out.append((label, text[start:].strip()))
    return out


def _connective_at(text: str, i: int) -> tuple[int, str] | None:
    """A list connective at `i` (comma, semicolon, and/or, ``\\land``...): its end and ``","``, ``"and"`` or
    ``"or"``."""
    m = _CONN_RE.match(text, i)
    if not m or (text[i] == "\\" and m.group(3) is None):
        return None
    word = m.group(1) or m.group(2) or m.group(3) or ","
    label = {"land": "and", "wedge": "and", "lor": "or", "vee": "or"}.get(word, word)
    return m.end(), "," if label == ";" else label


def _split_items(text: str) -> list[tuple[str, str]]:
    """The top-level items of `text` (outside brackets), each with the connective before it:
    ``""`` (first), ``","``, ``"and"`` or ``"or"``."""
    return _split_top_level(text, _connective_at)


def _top_split(text: str, sep: str) -> list[str]:
    """`text` split at the top-level occurrences of the command `sep` (``\\cup``, ``\\setminus``)."""

    def command_at(text: str, i: int) -> tuple[int, str] | None:
        end = i + len(sep)
        return (end, sep) if text.startswith(sep, i) and not text[end:end + 1].isalpha() else None

    return [part for _, part in _split_top_level(text, command_at)]


def _unwrap_set(text: str) -> str | None:
    """The inside of ``\\{ ... \\}`` when the braces enclose the whole text, else None."""
    if not (text.startswith("\\{") and text.endswith("\\}")):
        return None
    depth = 0
    for k in range(1, len(text)):
        if text[k] in "([{":
            depth += 1
        elif text[k] in ")]}":
            depth -= 1
            if depth == 0 and k != len(text) - 1:
                return None
    return text[2:-2].strip()


def _combine(structural: Outcome | None, base: Outcome) -> Outcome:
    """A structural rule's outcome against the structure rules': they must not contradict."""
    if structural is None:
        return base
    if structural.grade == UNSETTLED:
        return base if base.grade != UNSETTLED or not structural.detail else structural
    if base.grade not in (MATCH, MISMATCH) or base.grade == structural.grade:
        return structural
    if structural.rule in ("congruence-progression", "prose-set") and structural.grade == MATCH:
        return structural     # n = 4m-1 for n = 4k+3: the parameters are dummies, not values to compare
    return Outcome(UNSETTLED, structural.rule, f"two readings disagree: {structural.rule} says {structural.grade} "
                   f"({structural.detail}), the {base.rule} rule says {base.grade} ({base.detail})")


# ---------------------------------------------------------------- degrees

def degrees(answer: str, gold: str, compare: Compare) -> Outcome | None:
    """Rule ``degrees`` (`compare`: the whole comparison, applied to the texts without their degree signs): a degree sign (``^\\circ``, ``^{\\circ}``, ``°``, ``\\degree``) on one or both
    sides. Degrees against a reference without ``\\pi`` (``180^\\circ - 2\\alpha`` for ``180 -
    2\\alpha``): compared without the signs (the reference's numbers are degrees). Degrees against
    radians (``60^\\circ`` for ``\\frac{\\pi}{3}``): settled only for numbers (``x^\\circ`` is
    ``x\\pi/180``); with symbols (``180^\\circ - 2\\alpha`` for ``\\pi - 2\\alpha``: is ``\\alpha`` in
    degrees or radians?) unsettled. Without any degree sign, an answer that becomes the reference when
    ``\\pi`` is read as 180 (``\\pi - 2\\alpha`` for ``180 - 2\\alpha``) is unsettled, not different.
    The texts are read through `clean`, so degree words (``72 \\text{ degrees}``) are degree signs. A
    percent sign on either side is the ``percent`` rule's (`percent`), the other unit sign."""
    answer, gold = clean(answer), clean(gold)
    if _PERCENT_SIGN.search(answer) or _PERCENT_SIGN.search(gold):
        return percent(answer, gold, compare)
    has_a, has_g = bool(_DEGREE.search(answer)), bool(_DEGREE.search(gold))
    if not (has_a or has_g):
        if ("\\pi" in answer) != ("\\pi" in gold):
            radians, other = (answer, gold) if "\\pi" in answer else (gold, answer)
            if re.search(r"(?<![\d.])(?:90|180|360)(?![\d.])", other):
                swapped = compare(radians.replace("\\pi", "(180)"), other)
                if swapped.grade == MATCH:
                    return Outcome(UNSETTLED, "degrees", "the same angle if pi is read as 180 degrees: radians "
                                   "for degrees (the judge decides)", final=True)
        return None
    bare_a, bare_g = _DEGREE.sub(" ", answer), _DEGREE.sub(" ", gold)
    radians = (has_a and not has_g and "\\pi" in gold) or (has_g and not has_a and "\\pi" in answer)
    if not radians:
        inner = compare(bare_a, bare_g)
        return Outcome(inner.grade, "degrees", f"degree signs dropped: {inner.detail}", final=True)
    deg_side, other = (answer, gold) if has_a else (gold, answer)
    converted = re.sub(r"(\d+(?:\.\d+)?)\s*(?:" + _DEGREE.pattern + ")", r"(\1\\cdot\\frac{\\pi}{180})", deg_side)
    letters = re.sub(r"\\(?:pi|frac|cdot|times|sqrt|left|right|dfrac|tfrac)(?![A-Za-z])", "", converted + other)
    if _DEGREE.search(converted) or re.search(r"[A-Za-z]", letters):
        return Outcome(UNSETTLED, "degrees", "degrees against radians with symbols or a degree sign on an "
                       "expression: the unit of the symbols is unknown", final=True)
    inner = compare(converted, other)
    return Outcome(inner.grade, "degrees", f"degrees as radians (x° = x·π/180): {inner.detail}", final=True)


_PERCENT_SIGN = re.compile(r"\\%")


def percent(answer: str, gold: str, compare: Compare) -> Outcome:
    """Rule ``percent`` (from `degrees`; texts already `clean`, ``%`` spelled ``\\%``): a percent sign on one
    or both sides. Both: compared without the signs. One side: equal when the numbers are equal without
    the sign (``96\\%`` for the reference ``96``: the reference's number is the percentage); the same
    value as a fraction (``96\\%`` for ``0.96``) is unsettled (the problem says which is asked); different
    when both readings are proved different."""
    bare_a, bare_g = _PERCENT_SIGN.sub(" ", answer), _PERCENT_SIGN.sub(" ", gold)
    inner = compare(bare_a, bare_g)
    if bool(_PERCENT_SIGN.search(answer)) == bool(_PERCENT_SIGN.search(gold)) or inner.grade == MATCH:
        return Outcome(inner.grade, "percent", f"percent signs dropped: {inner.detail}", final=True)
    as_fraction = _PERCENT_SIGN.sub(lambda _: "*\\frac{1}{100}", answer if "\\%" in answer else gold)
    other = gold if "\\%" in answer else answer
    fraction = compare(as_fraction, other)
    if fraction.grade == MATCH:
        return Outcome(UNSETTLED, "percent", "the same value if the percentage is read as a fraction (the "
                       "problem decides)", final=True)
    if inner.grade == MISMATCH and fraction.grade == MISMATCH:
        return Outcome(MISMATCH, "percent", f"different as a percentage and as a fraction: {inner.detail}",
                       final=True)
    return Outcome(UNSETTLED, "percent", "a percentage the rules cannot compare exactly", final=True)


# ---------------------------------------------------------------- sets of integers (prose, ℤ, classes)

@dataclass(frozen=True)
class IntSet:
    """A set of integers: residue classes mod `modulus`, finite `extra` members, `excluded` members,
    powers ``{b^j : j >= e}`` for (b, e) in `powers`, primes (``all`` or ``odd``); `domain` is the
    declared range (``Z``, ``Z+``, ``Z>=0``, ``N`` (0 or not: ambiguous), None: the problem's)."""

    modulus: int = 1
    residues: frozenset = frozenset()
    extra: frozenset = frozenset()
    excluded: frozenset = frozenset()
    powers: frozenset = frozenset()
    primes: str = ""
    domain: str | None = None
    var: str | None = None
    strong: bool = True            # a set description (class, words, symbol), not a plain list or expression
    source: str = "congruence-progression"
    condition: bool = False        # a condition on the variable (n ≡ 1 mod 2, n is odd), not a noun
    param: str | None = None       # the parameter of a progression or power (k in 4k+3, 2^k)
    form: tuple | None = None      # ("linear", a, b) for a k + b, ("power", b) for b^k

    def _core(self, n: int) -> bool:
        from sympy import isprime

        if self.residues and n % self.modulus in self.residues:
            return True
        for base, least in self.powers:
            m, j = n, 0
            while m > 1 and m % base == 0:
                m, j = m // base, j + 1
            if m == 1 and n >= 1 and j >= least:
                return True
        return bool(self.primes) and n > 1 and isprime(n) and (self.primes == "all" or n != 2)

    def has(self, n: int) -> bool:
        return n not in self.excluded and (n in self.extra or self._core(n))

    def canonical(self) -> tuple:
        modulus, residues = self.modulus, frozenset(r % self.modulus for r in self.residues)
        for d in sorted(d for d in range(1, modulus + 1) if modulus % d == 0):
            reduced = frozenset(r % d for r in residues)
            if residues and all((r % d in reduced) == (r in residues) for r in range(modulus)):
                modulus, residues = d, reduced
                break
        powers = set(self.powers)
        extra = set(self.extra)
        for base, least in list(powers):
            while least > 0 and base ** (least - 1) in extra:
                extra.discard(base ** (least - 1))
                powers.discard((base, least))
                least -= 1
                powers.add((base, least))
        primes = self.primes
        if primes == "odd" and 2 in extra:
            primes = "all"
        shaped = IntSet(modulus, residues, frozenset(), frozenset(), frozenset(powers), primes)
        extra = {n for n in extra if not shaped._core(n)}
        excluded = {n for n in self.excluded if shaped._core(n) or n in extra}
        extra -= excluded
        return (modulus if residues else 0, residues, frozenset(extra), frozenset(excluded), frozenset(powers),
                primes)


def _union(a: IntSet, b: IntSet) -> IntSet | None:
    if a.domain and b.domain and a.domain != b.domain:
        return None
    if a.var and b.var and a.var != b.var:
        return None
    modulus = math.lcm(a.modulus, b.modulus)
    residues = frozenset(r for r in range(modulus) if (a.residues and r % a.modulus in a.residues)
                         or (b.residues and r % b.modulus in b.residues))
    primes = "all" if "all" in (a.primes, b.primes) else (a.primes or b.primes)
    if a.excluded or b.excluded:
        return None
    return IntSet(modulus, residues, a.extra | b.extra, frozenset(), a.powers | b.powers, primes,
                  a.domain or b.domain, a.var or b.var, a.strong or b.strong,
                  "prose-set" if "prose-set" in (a.source, b.source) else a.source, a.condition and b.condition)


def _intersection(a: IntSet, b: IntSet) -> IntSet | None:
    """Only of residue classes (``n ≡ 1 (mod 2) and n ≡ 0 (mod 3)``)."""
    if a.extra or b.extra or a.excluded or b.excluded or a.powers or b.powers or a.primes or b.primes:
        return None
    if (a.domain and b.domain and a.domain != b.domain) or (a.var and b.var and a.var != b.var):
        return None
    modulus = math.lcm(a.modulus, b.modulus)
    residues = frozenset(r for r in range(modulus) if r % a.modulus in a.residues and r % b.modulus in b.residues)
    return IntSet(modulus, residues, domain=a.domain or b.domain, var=a.var or b.var, source=a.source,
                  condition=True)


_SYMBOL_SETS = {
    "Z": ("\\mathbb{Z}",),
    "Z+": ("\\mathbb{Z}^+", "\\mathbb{Z}^{+}", "\\mathbb{Z}_+", "\\mathbb{Z}_{+}", "\\mathbb{Z}_{>0}", "\\mathbb{Z}^{>0}",
           "\\mathbb{Z}_{\\geq1}", "\\mathbb{N}^*", "\\mathbb{N}^{*}", "\\mathbb{N}^+", "\\mathbb{N}^{+}", "\\mathbb{N}_+",
           "\\mathbb{N}_{+}", "\\mathbb{N}_{>0}", "\\mathbb{N}_{\\geq1}", "\\mathbb{N}\\setminus\\{0\\}",
           "\\mathbb{Z}^*_+"),
    "Z>=0": ("\\mathbb{Z}_{\\geq0}", "\\mathbb{Z}^{\\geq0}", "\\mathbb{Z}_{\\geq 0}", "\\mathbb{N}_0", "\\mathbb{N}_{0}",
             "\\mathbb{N}\\cup\\{0\\}", "\\mathbb{Z}^+\\cup\\{0\\}", "\\mathbb{Z}_{+}\\cup\\{0\\}"),
    "N": ("\\mathbb{N}",),
}
_SYMBOL_OF = {s: d for d, spellings in _SYMBOL_SETS.items() for s in spellings}
_LOWER_OF_DOMAIN = {"Z": None, "Z+": 1, "Z>=0": 0}


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _linear_or_power(expr_text: str, not_var: str | None = None) -> tuple[str, Any, Any, str] | None:
    """``a k + b`` (integers, |a| >= 2) -> ("linear", a, b, k); ``b^k`` (integer b >= 2) -> ("power",
    b, None, k); else None."""
    import sympy

    try:
        expr = parse_expression(expr_text)
    except Exception:    # noqa: BLE001
        return None
    if len(expr.free_symbols) != 1:
        return None
    (k,) = expr.free_symbols
    if not_var is not None and k.name == not_var:
        return None
    if expr.is_Pow and expr.base.is_Integer and expr.base >= 2 and expr.exp == k:
        return ("power", int(expr.base), None, k.name)
    try:
        poly = sympy.Poly(expr, k)
    except sympy.PolynomialError:
        return None
    if poly.degree() != 1 or not all(c.is_Integer for c in poly.all_coeffs()):
        return None
    a, b = (int(c) for c in poly.all_coeffs())
    return ("linear", a, b, k.name) if abs(a) >= 2 else None


def _qualifier_lower(text: str, param: str) -> tuple[bool, int | None]:
    """A range for the parameter: (understood, least value or None for all integers)."""
    q = _squash(text).strip("()").lstrip(",")
    q = re.sub(r"^(?:for|where|with)", "", q)
    q = re.sub(r"^(?:some|all|any|every|each)", "", q)
    q = re.sub(r"(?:an|a)?(?:integers?)$", "", q) if q.startswith(param) else q
    words = {"": None, "integer": None, "integers": None, "nonnegativeinteger": 0, "nonnegativeintegers": 0,
             "non-negativeinteger": 0, "non-negativeintegers": 0, "positiveinteger": 1, "positiveintegers": 1}
    m = re.fullmatch(r"([a-z-]*)" + re.escape(param), q)
    if m and m.group(1) in words:
        return True, words[m.group(1)]
    m = re.fullmatch(re.escape(param) + r"(\\geq|>)(-?\d+)", q)
    if m:
        return True, int(m.group(2)) + (1 if m.group(1) == ">" else 0)
    m = re.fullmatch(re.escape(param) + r"\\in(.+)", q)
    if m and m.group(1) in _SYMBOL_OF and _SYMBOL_OF[m.group(1)] != "N":
        return True, _LOWER_OF_DOMAIN[_SYMBOL_OF[m.group(1)]]
    return False, None


def _form_set(expr_text: str, qualifier: str | None, var: str | None, source: str) -> IntSet | None:
    """The integers ``a k + b`` or ``b^k`` for the parameter's range (`qualifier`; none: all integers
    k for ``a k + b``, and j >= 0 for ``b^j``, the only integer powers)."""
    form = _linear_or_power(expr_text, var)
    if form is None:
        return None
    kind, a, b, param = form
    least = None
    if qualifier is not None:
        understood, least = _qualifier_lower(qualifier, param)
        if not understood:
            return None
    if kind == "power":
        if least is not None and least < 0:
            return None
        return IntSet(powers=frozenset({(a, least or 0)}), var=var, source=source, param=param, form=("power", a))
    modulus, residue = abs(a), b % abs(a)
    if least is None:
        return IntSet(modulus, frozenset({residue}), var=var, source=source, param=param, form=("linear", a, b))
    start = a * least + b
    if a < 0 or start < 1:
        return None
    below = frozenset(range(residue or modulus, start, modulus))
    return IntSet(modulus, frozenset({residue}), excluded=below, domain="Z+", var=var, source=source)


def _split_qualifier(text: str) -> tuple[str, str | None]:
    """``2^k (k \\geq 0)``, ``2^k for k \\geq 0``: the form and its qualifier."""
    m = re.match(r"^(.*?)\s*(?:\(([^()]*)\)|\s(?:for|where|with)\s(.+))$", text)
    if m and m.group(1):
        return m.group(1).strip(), (m.group(2) or m.group(3)).strip()
    return text, None


def _prose_item(item: str) -> IntSet | None:
    """An English description of a set of integers (see `int_set`)."""
    p = "prose-set"
    s = re.sub(r"(?<![\\A-Za-z])[A-Za-z]{2,}", lambda m: m.group(0).lower(), item)
    s = s.replace("non-negative", "nonnegative").strip()
    m = re.fullmatch(r"(?:all|every|any) ([A-Za-z])", s)
    if m:
        return IntSet(1, frozenset({0}), var=m.group(1), source=p)
    s = re.sub(r"^(?:(?:all|every|any|exactly|precisely|only|the)\s+)+", "", s)
    v = r"(?: ([A-Za-z]))?"
    domains = {"positive": "Z+", "nonnegative": "Z>=0", None: None}
    m = re.fullmatch(r"(?:(positive|nonnegative) )?(integers?|natural numbers?)" + v, s)
    if m:
        domain = "N" if m.group(2).startswith("natural") else domains[m.group(1)] or "Z"
        if m.group(2).startswith("natural") and m.group(1):
            return None
        return IntSet(1, frozenset({0}), domain=domain, var=m.group(3), source=p)
    m = re.fullmatch(r"(?:(positive|nonnegative) )?(odd|even)(?: (positive|nonnegative))?"
                     r"(?: (integers?|numbers?|natural numbers?))?" + v, s)
    if m and (m.group(4) or m.group(5) or s in ("odd", "even")):
        adjective = m.group(1) or m.group(3)
        domain = domains[adjective] or ("Z" if (m.group(4) or "").startswith("integer") else None)
        return IntSet(2, frozenset({1 if m.group(2) == "odd" else 0}), domain=domain, var=m.group(5), source=p)
    m = re.fullmatch(r"([A-Za-z]) (?:is |are )?(?:an? )?(odd|even)(?: (?:integer|number))?", s)
    if m:
        return IntSet(2, frozenset({1 if m.group(2) == "odd" else 0}), var=m.group(1), source=p, condition=True)
    m = re.fullmatch(r"(?:(positive) )?(?:integer )?multiples of (\d+)" + v, s) or \
        re.fullmatch(r"(?:(positive) )?(?:integers|numbers) divisible by (\d+)" + v, s)
    if m and int(m.group(2)) >= 1:
        return IntSet(int(m.group(2)), frozenset({0}), domain=domains[m.group(1)], var=m.group(3), source=p)
    m = re.fullmatch(r"([A-Za-z]) (?:is )?(?:an? )?(?:multiple of|divisible by) (\d+)", s)
    if m and int(m.group(2)) >= 1:
        return IntSet(int(m.group(2)), frozenset({0}), var=m.group(1), source=p, condition=True)
    m = re.fullmatch(r"(?:(positive) )?(?:integers|numbers|[A-Za-z])(?: ([A-Za-z]))? of the form (.+)", s)
    if m:
        form, qualifier = _split_qualifier(m.group(3))
        found = _form_set(form, qualifier, m.group(2), p)
        if found is not None and m.group(1):
            found = replace(found, domain="Z+") if not found.domain else found
        return found
    m = re.fullmatch(r"(?:(nonnegative|integer|integral) )?powers of (\d+|[a-z]+)" + v, s) or \
        re.fullmatch(r"([A-Za-z]) (?:is )?(?:an? )?(?:(nonnegative|integer) )?power of (\d+|[a-z]+)", s)
    if m:
        groups = m.groups()
        base_word = groups[1] if len(groups[0] or "") != 1 else groups[2]
        var = groups[2] if len(groups[0] or "") != 1 else groups[0]
        base = int(base_word) if base_word.isdigit() else _NUMBER_WORDS.get(base_word, 0)
        if base >= 2:
            return IntSet(powers=frozenset({(base, 0)}), var=var, source=p, condition=len(groups[0] or "") == 1)
        return None
    m = re.fullmatch(r"(odd )?primes?(?: numbers?)?" + v, s) or re.fullmatch(r"(odd )?prime numbers" + v, s)
    if m:
        return IntSet(primes="odd" if m.group(1) else "all", var=m.group(2), source=p)
    m = re.fullmatch(r"([A-Za-z]) (?:is )?(?:an? )?(odd )?prime(?: number)?", s)
    if m:
        return IntSet(primes="odd" if m.group(2) else "all", var=m.group(1), source=p, condition=True)
    if re.fullmatch(r"(?:no|none)(?: (?:positive |such )?(?:integers?|solutions?|values?|numbers?|[A-Za-z]|such [A-Za-z]))?"
                    r"|there (?:is|are|exist) no (?:such )?(?:solutions?|integers?|values?|[A-Za-z])"
                    r"|\\emptyset|\\\{\s*\\\}", s):
        return IntSet(source=p)
    return None


def _int_item(item: str) -> IntSet | None:
    """One item of `int_set`; ``n \\in S`` is S for the variable n."""
    s = item.strip()
    m = re.fullmatch(rf"({_VAR})\s*\\in(?![A-Za-z])\s*(.+)", s)
    if m:
        found = _int_body(m.group(2).strip())
        if found is None or (found.var and found.var != m.group(1)):
            return None
        return replace(found, var=m.group(1))
    return _int_body(s)


def _int_body(s: str) -> IntSet | None:
    if re.fullmatch(r"-?\d+", s):
        return IntSet(extra=frozenset({int(s)}), strong=False)
    squashed = _squash(s)
    m = re.fullmatch(r"\\mathbb\{[ZN]\}_\{(\\geq|>)(\d+)\}", squashed)
    if m and squashed not in _SYMBOL_OF:           # Z_{>=2}: the integers from 2 on
        least = int(m.group(2)) + (m.group(1) == ">")
        if least >= 1:
            return IntSet(1, frozenset({0}), excluded=frozenset(range(1, least)), domain="Z+", source="prose-set")
    if squashed in _SYMBOL_OF:
        return IntSet(1, frozenset({0}), domain=_SYMBOL_OF[squashed], source="prose-set")
    m = re.fullmatch(r"(\d+)\\mathbb\{Z\}(?:([+-])(\d+))?", squashed)
    if m and int(m.group(1)) >= 1:
        modulus = int(m.group(1))
        shift = int(m.group(3) or 0) * (-1 if m.group(2) == "-" else 1)
        return IntSet(modulus, frozenset({shift % modulus}), domain="Z", source="prose-set")
    if squashed in ("\\emptyset", "\\{\\}"):
        return IntSet(source="prose-set")
    m = re.fullmatch(rf"({_VAR})\s*\\equiv\s*(.+?)\s*\\MOD\{{(\d+)\}}", s)
    if m and int(m.group(3)) >= 1:
        residues = set()
        for r in m.group(2).split("¦"):
            r = _squash(r)
            if re.fullmatch(r"-?\d+", r):
                residues.add(int(r))
            elif re.fullmatch(r"\\(?:pm|mp)\d+", r):
                residues |= {int(r[3:]), -int(r[3:])}
            else:
                return None
        modulus = int(m.group(3))
        return IntSet(modulus, frozenset(x % modulus for x in residues), var=m.group(1), condition=True)
    m = re.fullmatch(rf"(\d+)\s*(?:\\MID|\|)\s*({_VAR})", s)
    if m and int(m.group(1)) >= 1:
        return IntSet(int(m.group(1)), frozenset({0}), var=m.group(2), condition=True)
    inner = _unwrap_set(s)
    if inner is not None:
        if re.fullmatch(r"-?\d+(?:\s*,\s*-?\d+)*", inner):
            return IntSet(extra=frozenset(int(x) for x in inner.split(",")), strong=False)
        m = re.fullmatch(r"(.+?)\s*(?::|\\MID|\|)\s*(.+)", inner)
        if m and _PLAIN.fullmatch(m.group(1).strip()):
            found = int_set(m.group(2))
            if found is None or (found.var and found.var != m.group(1).strip()):
                return None
            return replace(found, var=m.group(1).strip(), strong=True, condition=False)
        if m:
            return _form_set(m.group(1), m.group(2), None, "congruence-progression")
        return None
    m = re.fullmatch(rf"({_VAR})\s*=\s*(.+)", s)
    if m:
        form, qualifier = _split_qualifier(m.group(2))
        return _form_set(form, qualifier, m.group(1), "congruence-progression")
    form, qualifier = _split_qualifier(s)
    found = _form_set(form, qualifier, None, "congruence-progression")
    if found is not None:
        return replace(found, strong=qualifier is not None)
    return _prose_item(s)


def _is_qualifier_of(item: str, previous: str) -> bool:
    """``k \\geq 0`` after ``n = 2^k``: a range for the previous item's parameter."""
    m = re.fullmatch(r"([A-Za-z])\s*(?:\\geq|>|\\in(?![A-Za-z]))\s*\S.*", item.strip())
    return bool(m) and re.search(rf"(?<![A-Za-z\\]){m.group(1)}(?![A-Za-z])", previous.split("=")[-1]) is not None


def int_set(text: str) -> IntSet | None:
    """A set of integers described by `text`, or None. Read: integers; ``\\mathbb{Z}``, ``\\mathbb{Z}^+``
    (and ``\\mathbb{Z}_{>0}``, ``\\mathbb{N}^*``, ...), ``\\mathbb{Z}_{\\geq 0}``/``\\mathbb{N}_0``,
    ``\\mathbb{N}``, ``2\\mathbb{Z}+1``, ``\\emptyset``; congruences ``n \\equiv 3 \\pmod 4`` (residue lists,
    ``\\pm``), ``4 \\mid n``; progressions ``n = 4k+3``, ``4k+3``, powers ``2^k``, ``n = 2^k, k \\geq 1``,
    set-builder ``\\{2^k : k \\geq 0\\}``; English: all/odd/even (positive) integers, ``odd n``, ``n is
    odd``, multiples of 14, numbers of the form 4k+3, powers of 2, (odd) primes, no solutions; items
    joined by commas, and, or; ``excluding 0``."""
    s = _prep(text)
    s = re.sub(r"(\\equiv)([^=]*?)(\\MOD\{\d+\})", lambda m: m.group(1) + m.group(2).replace(",", "¦") + m.group(3), s)
    excluded: frozenset = frozenset()
    m = _EXCEPT.search(s)
    if m:
        numbers = re.split(r"\s*(?:,|\band\b|\bor\b)\s*", m.group(1).strip())
        if not all(re.fullmatch(r"-?\d+", x) for x in numbers if x):
            return None
        excluded = frozenset(int(x) for x in numbers if x)
        s = s[:m.start()].strip()
    items = _split_items(s)
    merged: list[tuple[str, str]] = []
    for sep, item in items:
        if merged and _is_qualifier_of(item, merged[-1][1]):
            merged[-1] = (merged[-1][0], f"{merged[-1][1]} ({item})")
        else:
            merged.append((sep, item))
    readings = [_int_item(item) for _, item in merged]
    if not merged or any(r is None for r in readings):
        return None
    seps = {sep for sep, _ in merged[1:]}
    if len(readings) > 1 and any(r.condition for r in readings) and seps & {"and", ","}:
        # conditions joined by "and" are an intersection; by commas: a union when the intersection is
        # empty (n ≡ 1, n ≡ 3 (mod 4) lists solutions) or both readings agree, else not read
        if not all(r.condition for r in readings) or "or" in seps:
            return None
        union, meet = _fold(readings, _union), _fold(readings, _intersection)
        if seps == {"and"}:
            result = meet
        elif meet is not None and union is not None and (not meet.canonical()[1]
                                                          or union.canonical() == meet.canonical()):
            result = union
        else:
            return None
    else:
        result = _fold(readings, _union)
    if result is None:
        return None
    return replace(result, excluded=result.excluded | excluded) if excluded else result


def _fold(readings: list[IntSet], op: Any) -> IntSet | None:
    result = readings[0]
    for r in readings[1:]:
        result = op(result, r)
        if result is None:
            return None
    return result


def int_sets(answer: str, gold: str, problem: str | None = None) -> Outcome | None:
    """Rules ``prose-set`` and ``congruence-progression``: both sides read by `int_set`, at least one a
    set description (not a plain list or a bare ``4k+3``). Equal when the canonical forms (residues
    mod the least period, extra and excluded members, powers, primes) are the same and the declared
    domains agree (or one is the problem's); different when an integer from 1 to 400 (or from -400 when
    both are all of ``\\mathbb{Z}``) is in one and not the other; else unsettled (``\\mathbb{Z}`` and
    ``\\mathbb{Z}^+`` with the same classes, prose on both sides). With the problem's domain for the
    variable (`declared_domain`, integers or primes), the sets are compared on that domain only: the same
    classes over declared domains that both contain it are equal, and a witness must be in it (from -400
    to 400; never 0 when ℕ may or may not hold it)."""
    a, g = int_set(answer), int_set(gold)
    if a is None or g is None or not (a.strong or g.strong):
        return None
    rule = "prose-set" if "prose-set" in (a.source, g.source) else "congruence-progression"
    if _wordy(answer) and _wordy(gold):
        return Outcome(UNSETTLED, rule, "both are worded in prose (the judge compares wordings)")
    if a.var and g.var and a.var != g.var:
        return Outcome(UNSETTLED, rule, f"sets of different variables: {a.var} and {g.var}")
    domain = declared_domain(problem, a.var or g.var)
    if domain is not None and domain.kind not in ("Z", "P"):
        domain = None             # reals or a bare bound: the sets of integers are compared as without it
    same = a.canonical() == g.canonical()
    if same and domain is not None and not (_covers(a.domain, domain) and _covers(g.domain, domain)):
        same = False              # Z+ against the problem's Z: 0 and the negatives decide (witnesses below)
    elif same and domain is not None and a.domain and g.domain and a.domain != g.domain:
        return Outcome(MATCH, rule, "the same classes on the problem's domain")
    if same:
        if a.param and a.param == g.param and a.form != g.form:
            return Outcome(UNSETTLED, rule, f"the same class, but {a.param} may be given: as expressions in "
                           f"{a.param} they differ", final=True)
        if a.domain and g.domain and a.domain != g.domain:
            return Outcome(UNSETTLED, rule, f"the same classes over different domains: {a.domain} and {g.domain}")
        if not g.strong and g.param:
            return Outcome(UNSETTLED, rule, f"the reference {gold.strip()} may be a value in a given {g.param}, "
                           "not a set", final=True)
        return Outcome(MATCH, rule, "the same set of integers")
    if domain is not None:
        return _int_witness(a, g, rule, domain)
    low = -400 if a.domain == g.domain == "Z" else 1
    for n in range(1, 401) if low == 1 else sorted(range(low, 401), key=abs):
        if a.has(n) != g.has(n):
            return Outcome(MISMATCH, rule, f"{n} is in {'the answer' if a.has(n) else 'the reference'} only")
    return Outcome(UNSETTLED, rule, "different descriptions, no difference found among small integers")


_DECLARED_LEAST = {"Z": None, "Z+": 1, "Z>=0": 0, "N": 1}


def _covers(declared: str | None, domain: Domain) -> bool:
    """Does a set's declared range (`IntSet.domain`; None: the problem's) contain the problem's integer
    `domain` under every reading? (ℕ contains the positive integers; 0 only perhaps.)"""
    if declared is None or declared == "Z":
        return True
    if domain.least is None:
        return False
    if declared == "N" and domain.zero_maybe:
        return True               # ℕ in both: the same convention
    least = 0 if domain.zero_maybe else domain.least
    return least >= _DECLARED_LEAST[declared]


def _int_witness(a: IntSet, g: IntSet, rule: str, domain: Domain) -> Outcome:
    """Rules ``prose-set``/``congruence-progression`` on the problem's integer `domain`: different when a
    member of it from -400 to 400 (smallest first) is in one set only (each set also within its own
    declared range; 0 is no witness when a range is ℕ), else unsettled."""
    ambiguous_zero = domain.zero_maybe or "N" in (a.domain, g.domain)

    def member(s: IntSet, n: int) -> bool:
        least = _DECLARED_LEAST.get(s.domain or "Z")
        return s.has(n) and (least is None or n >= least)

    for n in sorted(range(-400, 401), key=lambda k: (abs(k), k)):
        if not domain.has_int(n) or (n == 0 and ambiguous_zero):
            continue
        if member(a, n) != member(g, n):
            return Outcome(MISMATCH, rule, f"{n} is in {'the answer' if member(a, n) else 'the reference'} only "
                           "(a member of the problem's domain)")
    return Outcome(UNSETTLED, rule, "different descriptions, no difference found among small members of the "
                   "problem's domain")


# ---------------------------------------------------------------- the problem text: tuple order, domains
#
# Two facts read from the problem statement when `structural` is given one (`problem`): the order of a
# named tuple (``Find all triples $(n, x, y)$``) and the declared domain of a variable (``positive
# integers $n$``). Both readers are small and explicit: what they do not recognise is None, and the rules
# then behave as without the problem text.

#: a parenthesised tuple of (subscripted) letters, not a function's arguments (``f(x, y)``, ``P(a,b)``)
_PROBLEM_TUPLE = re.compile(rf"(?<![A-Za-z0-9}}\)\]^_'])\(\s*({_VAR}(?:\s*,\s*{_VAR})+)\s*\)")
_ADJECTIVE = r"(?:((?i:positive|nonnegative|non-negative|negative|odd))\s+)?"
_TYPE = r"((?i:integers?|natural\s+numbers?|prime\s+numbers?|primes?|real\s+numbers?|reals?)(?![A-Za-z]))"
_VAR_ALONE = rf"{_VAR}(?![A-Za-z0-9])"
_VAR_LIST = rf"({_VAR_ALONE}(?:\s*(?:,|and)\s*{_VAR_ALONE})*)"
_REL_SPLIT = re.compile(r"(\\geq|\\leq|\\neq|\\ne(?![A-Za-z])|<|>|=)")


def _problem_text(problem: str) -> str:
    """The problem statement with math delimiters as spaces (``$``, ``\\(``, ``\\)``), ``\\left``/``\\right``
    dropped, ``\\ge``/``\\geqslant``/``≥`` as ``\\geq`` (the same for ``\\leq``), ``\\mathbb Z`` as
    ``\\mathbb{Z}``, ``\\text{…}`` as its words, runs of whitespace as one space. Not `clean`: only what the
    readers below need."""
    s = re.sub(r"\$|\\\(|\\\)|\\\[|\\\]", " ", problem)
    s = re.sub(r"\\(?:left|right|bigl|bigr|big|Big)(?![A-Za-z])", "", s)
    s = re.sub(r"\\ge(?:q(?:slant)?)?(?![A-Za-z])|≥", r"\\geq", s)
    s = re.sub(r"\\le(?:q(?:slant)?)?(?![A-Za-z])|≤", r"\\leq", s)
    s = re.sub(r"\\(?:mathbb|Bbb)\s*\{?\s*([A-Z])\s*\}?", r"\\mathbb{\1}", s)
    s = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r" \1 ", s)
    return re.sub(r"\s+", " ", s)


def _name_key(name: str) -> str:
    """A component name as one key: ``x_{1}`` and ``x_1`` are the same name, spaces do not count."""
    return re.sub(r"_\{([A-Za-z0-9])\}", r"_\1", re.sub(r"\s+", "", name))


def declared_order(problem: str | None, names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The order in which the problem lists the components `names` (as name keys, see `_name_key`): the
    FIRST parenthesised tuple of (subscripted) letters in `problem` with as many components and the same
    set of names (``Find all triples $(n, x, y)$``, ``ordered pairs (a,b)``, ``$\\left(p,a,b\\right)$``),
    or None (no problem text, no such tuple, repeated names). A tuple right after a letter or a bracket
    is a function's arguments (``f(x,y)``), not a declared order."""
    if not problem or not names:
        return None
    wanted = [_name_key(n) for n in names]
    if len(set(wanted)) != len(wanted):
        return None
    for m in _PROBLEM_TUPLE.finditer(_problem_text(problem)):
        found = tuple(_name_key(n) for n in re.split(r"\s*,\s*", m.group(1).strip()))
        if len(found) == len(wanted) and set(found) == set(wanted):
            return found
    return None


@dataclass(frozen=True)
class Domain:
    """The declared range of one variable. `kind`: ``Z`` integers, ``P`` primes, ``R`` reals, ``""`` a bound
    only (the type is not said). `least`: the least value (None: unbounded below; for ``Z``/``P`` the least
    integer, for ``R``/``""`` a real bound, open when `open_below`). `zero_maybe`: ℕ, where 0 may or may not
    be a member (`least` is 1: a witness must avoid 0, an equality must hold at 0 too)."""

    kind: str
    least: Any = None
    open_below: bool = False
    zero_maybe: bool = False

    def hull(self, sure: bool = True) -> Any:
        """The reals from the least value on (`sure=False`: the larger reading, from 0 for ℕ)."""
        import sympy

        if self.least is None:
            return sympy.S.Reals
        least = 0 if (self.zero_maybe and not sure) else self.least
        return sympy.Interval(least, sympy.oo, self.open_below, True)

    def has_int(self, n: int, sure: bool = True) -> bool:
        """Is the integer `n` in the domain (`sure=False`: in its larger reading)?"""
        from sympy import isprime

        if self.least is not None:
            least = 0 if (self.zero_maybe and not sure) else self.least
            if n < least or (n == least and self.open_below):
                return False
        return self.kind != "P" or isprime(n)


def _worded_domain(adjective: str | None, noun: str) -> Domain | None:
    """A type in words (``positive integers``, ``odd primes``, ``natural numbers``, ``real numbers``)."""
    noun = re.sub(r"\s+", " ", noun.lower())
    adjective = (adjective or "").lower().replace("-", "")
    if noun.startswith("natural"):
        return Domain("Z", 1, zero_maybe=True) if not adjective else None
    if noun.startswith("prime"):
        return Domain("P", 3 if adjective == "odd" else 2) if adjective in ("", "odd", "positive") else None
    if adjective in ("odd", "negative"):
        return None           # odd integers, negative reals: not a range from a least value
    if noun.startswith("integer"):
        return Domain("Z", {"": None, "positive": 1, "nonnegative": 0}[adjective])
    if adjective == "positive":
        return Domain("R", 0, open_below=True)
    return Domain("R", 0) if adjective == "nonnegative" else Domain("R")


_SYMBOL_DOMAIN = {"Z": Domain("Z"), "Z+": Domain("Z", 1), "Z>=0": Domain("Z", 0), "N": Domain("Z", 1, zero_maybe=True)}
_POSITIVE_REALS = ("\\mathbb{R}^+", "\\mathbb{R}^{+}", "\\mathbb{R}_+", "\\mathbb{R}_{+}", "\\mathbb{R}_{>0}")


def _symbol_domain(symbol: str) -> Domain | None:
    """``\\mathbb{Z}^+``, ``\\mathbb{N}``, ``\\mathbb{R}``, ``\\mathbb{R}^+`` ... as a domain."""
    squashed = _squash(symbol)
    if squashed in _SYMBOL_OF:
        return _SYMBOL_DOMAIN[_SYMBOL_OF[squashed]]
    if squashed == "\\mathbb{R}":
        return Domain("R")
    return Domain("R", 0, open_below=True) if squashed in _POSITIVE_REALS else None


def _with_bound(domain: Domain | None, strict: bool, bound: int) -> Domain:
    """`domain` raised to the lower bound ``var > bound`` (`strict`) or ``var >= bound`` (a bound without a
    type: kind ``""``)."""
    domain = domain or Domain("")
    if domain.kind in ("Z", "P"):
        least = bound + 1 if strict else bound
        if domain.least is None or least > domain.least:
            return replace(domain, least=least, zero_maybe=domain.zero_maybe and least < 1)
        return domain
    if domain.least is None or bound > domain.least or (bound == domain.least and strict):
        return replace(domain, least=bound, open_below=strict)
    return domain


def _lower_bounds(problem: str, var: str) -> list[tuple[bool, int]]:
    """The lower bounds on `var` stated in the problem's math segments (``$n \\geq 2$``, ``$x > n \\geq 2$``,
    ``$1 \\leq n \\leq 100$``), as (strict, bound): a side of a relation chain that is exactly the variable
    next to a side that is exactly an integer. Anything else (``n \\geq 2k``, ``x^2 \\leq n``) is no bound."""
    found = []
    for segment in re.findall(r"\$+([^$]+)\$+", re.sub(r"\\\(|\\\)", "$", problem)):
        for piece in re.split(r",|;|\\quad|\\text\{[^{}]*\}", _problem_text(segment)):
            parts = _REL_SPLIT.split(piece)
            sides, ops = [p.strip() for p in parts[0::2]], parts[1::2]
            for left, op, right in zip(sides, ops, sides[1:], strict=False):
                if left == var and re.fullmatch(r"-?\d+", right) and op in ("\\geq", ">"):
                    found.append((op == ">", int(right)))
                elif right == var and re.fullmatch(r"-?\d+", left) and op in ("\\leq", "<"):
                    found.append((op == "<", int(left)))
    return found


def declared_domain(problem: str | None, var: str | None) -> Domain | None:
    """The domain the problem declares for the variable `var`, or None. Read: a type in words before the
    variable (``positive integers $n$``, ``all primes p``, ``integers $a, b$``, ``pairs of positive integers
    (a, b)``, ``real numbers x``, ``natural numbers n``) or after it (``$n$ is a positive integer``, ``Let
    $n \\geq 2$ be an integer``), a symbol (``n \\in \\mathbb{Z}^+``, ``\\mathbb{N}``, ``\\mathbb{R}``), and
    lower bounds on it (``n \\geq 2``, ``n > 1``, ``1 \\leq n``; see `_lower_bounds`) that raise the least
    value (a bound without a type is a domain of kind ``""``). The first type found counts; negative or odd
    integers, rationals and upper bounds are not read (a larger domain only makes the rules more careful)."""
    if not problem or not var:
        return None
    text = _problem_text(problem)
    v = re.escape(var)
    domain = None
    for m in re.finditer(rf"(?<![A-Za-z]){_ADJECTIVE}{_TYPE}\s+\(?\s*{_VAR_LIST}", text):
        if var in re.split(r"\s*(?:,|and)\s*", m.group(3)):
            domain = _worded_domain(m.group(1), m.group(2))
            break
    if domain is None:
        m = re.search(rf"(?<![A-Za-z\\]){v}(?![A-Za-z0-9])(?:\s*(?:\\geq|>)\s*-?\d+)?\s+(?:is|be|are)\s+(?:an?\s+)?"
                      rf"{_ADJECTIVE}{_TYPE}", text)
        if m:
            domain = _worded_domain(m.group(1), m.group(2))
    if domain is None:
        m = re.search(rf"(?<![A-Za-z\\]){v}\s*\\in\s*(\\mathbb\{{[A-Z]\}}(?:\s*[\^_]\s*(?:\{{[^{{}}]*\}}|[^\s{{}}]))?)", text)
        if m:
            domain = _symbol_domain(m.group(1))
    for strict, bound in _lower_bounds(problem, var):
        domain = _with_bound(domain, strict, bound)
    return domain


# ---------------------------------------------------------------- value lists: ±, solution lists, named tuples

@dataclass
class _Shape:
    items: list[str]
    collection: bool
    var: str | None = None
    names: tuple[str, ...] | None = None
    ordered: bool = True
    rules: set[str] = field(default_factory=set)


def _expand_pm(item: str) -> list[str] | None:
    """``a \\pm b`` as ``a + b`` and ``a - b`` (``\\mp`` the other way); None with two or more signs."""
    count = len(re.findall(r"\\(?:pm|mp)(?![A-Za-z])", item))
    if count == 0:
        return [item]
    if count > 1 or any(op in item for op in ("<", ">", "\\leq", "\\geq", "\\ne", "\\equiv", "\\in")):
        return None
    plus = re.sub(r"\\pm(?![A-Za-z])", "+", re.sub(r"\\mp(?![A-Za-z])", "-", item))
    minus = re.sub(r"\\pm(?![A-Za-z])", "-", re.sub(r"\\mp(?![A-Za-z])", "+", item))
    return [plus, minus]


def _shape(text: str) -> _Shape | None:
    s = _prep(text)
    rules: set[str] = set()
    var = names = None
    m = re.fullmatch(rf"({_VAR}|\(\s*{_VAR}(?:\s*,\s*{_VAR})+\s*\))\s*\\in(?![A-Za-z])\s*(.+)", s)
    if m:
        head, s = m.group(1), m.group(2).strip()
        if head.startswith("("):
            names = tuple(re.split(r"\s*,\s*", head[1:-1].strip()))
            rules.add("named-tuple")
        else:
            var = head
            rules.add("solution-list")
        if _unwrap_set(s) is None:
            return None
    inner = _unwrap_set(s)
    collection = inner is not None
    raw = [item for _, item in _split_items(inner if inner is not None else s)]
    if any(not item for item in raw):
        return None
    items: list[str] = []
    for item in raw:
        expanded = _expand_pm(item)
        if expanded is None:
            return None
        if len(expanded) > 1:
            rules.add("plus-minus")
        items.extend(expanded)
    collection = collection or len(items) > 1
    named = [re.fullmatch(rf"\(\s*({_VAR}(?:\s*,\s*{_VAR})+)\s*\)\s*=\s*(\(.+\))", i) for i in items]
    labels = [re.fullmatch(rf"({_VAR})\s*=\s*([^=<>]+)", i) for i in items]
    if named[0]:
        names_here = tuple(re.split(r"\s*,\s*", named[0].group(1)))
        values = []
        for m, item in zip(named, items, strict=True):
            if m and tuple(re.split(r"\s*,\s*", m.group(1))) != names_here:
                return None
            values.append(m.group(2) if m else item)
        if len(set(names_here)) != len(names_here) or (names and names != names_here):
            return None
        names, items = names_here, values
        rules.add("named-tuple")
    elif all(labels) and len(items) > 1:
        heads = [m.group(1) for m in labels]
        bases = {re.sub(r"_.*", "", h) for h in heads}
        if len(set(heads)) == 1 or (len(bases) == 1 and len(set(heads)) == len(heads) and all("_" in h for h in heads)):
            var = var or bases.pop()
            items = [m.group(2) for m in labels]
            rules.add("solution-list")
        elif len(set(heads)) == len(heads) and not var and not names and "_" not in "".join(heads):
            names, items, ordered = tuple(heads), ["(" + ", ".join(m.group(2) for m in labels) + ")"], False
            return _Shape(items, False, None, names, ordered, {"named-tuple"})
        else:
            return None
    elif labels[0] and len(items) > 1 and not any(labels[1:]) and not var and \
            not any(re.search(r"[=<>]|\\leq|\\geq|\\ne", i) for i in items[1:]):
        var = labels[0].group(1)
        items = [labels[0].group(2)] + items[1:]
        rules.add("solution-list")
    elif var is None and names is None and len(items) == 1 and labels[0] and "plus-minus" not in rules:
        return _Shape([labels[0].group(2)], False, labels[0].group(1))     # x = 5: a solution list only
        # against a list (`value_lists`); alone, the structure rules read it
    return _Shape(items, collection, var, names, True, rules)


def _reorder(items: list[str], names: tuple[str, ...], order: tuple[str, ...]) -> list[str] | None:
    """Tuples written in the component order `names`, rewritten in the order `order`."""
    out = []
    for item in items:
        node = build(item)
        if node.kind != "tuple" or len(node.items or []) != len(names):
            return None
        parts = _split_items(item.strip()[1:-1])
        if len(parts) != len(names):
            return None
        by_name = dict(zip(names, (p for _, p in parts), strict=True))
        out.append("(" + ", ".join(by_name[n] for n in order) + ")")
    return out


def _tuple_values(items: list[str]) -> list[list[str]] | None:
    """The components of every item when each one is a tuple ``(…)``, else None."""
    out = []
    for item in items:
        text = item.strip()
        if not (text.startswith("(") and text.endswith(")")) or build(text).kind != "tuple":
            return None
        out.append([p for _, p in _split_items(text[1:-1])])
    return out


def _tuples_outcome(answer: list[list[str]], gold: list[list[str]], as_sets: bool) -> Outcome:
    """Tuples given by their components compared by the structure rules (as sets of tuples, or one
    tuple against one)."""
    a_nodes = [build("(" + ", ".join(t) + ")") for t in answer]
    g_nodes = [build("(" + ", ".join(t) + ")") for t in gold]
    if any(n.kind == "opaque" for n in a_nodes + g_nodes):
        return Outcome(UNSETTLED, "structure", "an item the rules cannot read")
    return _as_sets(a_nodes, g_nodes) if as_sets else nodes(a_nodes[0], g_nodes[0])


#: the most components whose every order is tried when the problem does not declare one (4! = 24 orders)
_MOST_ORDERS = 4


def _named_against_unnamed(a: _Shape, g: _Shape, rule: str, problem: str | None) -> Outcome | None:
    """Rule ``named-tuple`` when one side names its components (``(x,n,y) = (…)``, ``p=3, a=2, b=5``) and
    the other is unnamed tuples, which are in the problem's order of the names. With that order declared
    (`declared_order`), the named values are placed by name: equal or different, settled. Without it
    the problem's order is one unknown permutation of the names: equal when every order gives equal
    (``(x,y)=(0,0)``; ``(x,y)=(1,2),(2,1)`` for both pairs), different when every order gives different
    (or the values differ as sets), else unsettled: never accepted because the answer's own order fits.
    None when either side is not tuples (the structure rules compare them). Verdicts are final: reading
    ``(x,n,y) = (…)`` as a labelled value would match values in order, the very error ruled out here."""
    named, other = (a, g) if a.names else (g, a)
    values, plain = _tuple_values(named.items), _tuple_values(other.items)
    if values is None or plain is None:
        return None
    arity = len(named.names)
    if any(len(t) != arity for t in values):
        return Outcome(UNSETTLED, rule, "named components that cannot be matched", final=True)
    if any(len(t) != arity for t in plain):
        return Outcome(MISMATCH, rule, f"{arity} named components, the other side has tuples of another length",
                       final=True)
    as_sets = a.collection or g.collection or len(values) != 1 or len(plain) != 1

    def verdict(positions: list[int]) -> Outcome:
        """The named tuples with component positions[j] in place j, against the unnamed side."""
        placed = [[t[i] for i in positions] for t in values]
        return _tuples_outcome(placed, plain, as_sets) if named is a else _tuples_outcome(plain, placed, as_sets)

    order = declared_order(problem, named.names)
    if order is not None:
        keys = [_name_key(n) for n in named.names]
        outcome = verdict([keys.index(k) for k in order])
        return Outcome(outcome.grade, rule, f"components placed by name in the problem's order ({', '.join(order)}): "
                       f"{outcome.detail}", final=True)
    if len(values) == len(plain) == 1:       # one tuple each: values that differ as sets differ in any order
        anyhow = _as_sets([build(v) for v in values[0]], [build(v) for v in plain[0]])
        if anyhow.grade == MISMATCH:
            return Outcome(MISMATCH, rule, f"the named values are not the tuple's in any order: {anyhow.detail}",
                           final=True)
    unknown = Outcome(UNSETTLED, rule, f"named components ({', '.join(named.names)}) against unnamed tuples: the "
                      "problem's order of the names is not known (pass the problem text)", final=True)
    if arity > _MOST_ORDERS:
        return unknown
    grades = set()
    for positions in itertools.permutations(range(arity)):
        grades.add(verdict(list(positions)).grade)
        if len(grades) > 1:
            return unknown
    if grades == {MATCH}:
        return Outcome(MATCH, rule, "the same tuples in every order of the names", final=True)
    if grades == {MISMATCH}:
        return Outcome(MISMATCH, rule, "different tuples in every order of the names", final=True)
    return unknown


def value_lists(answer: str, gold: str, problem: str | None = None) -> Outcome | None:
    """Rules ``plus-minus``, ``solution-list`` and ``named-tuple``: the answer and the reference rewritten
    as lists of values, then compared by the structure rules (sets of values; tuples in order).

    - ``plus-minus``: an item with one ``\\pm`` (or ``\\mp``) is two items (``0, \\pm\\frac23`` is
      ``0, \\frac23, -\\frac23``); two or more in one item are not read.
    - ``solution-list``: ``x=5, x=-3``, ``x = 5 or x = -3``, ``x = 5, -3``, ``x_1 = 5, x_2 = -3`` and
      ``x \\in \\{5, -3\\}`` are the values ``5, -3`` (one variable; two different variables: unsettled).
    - ``named-tuple``: ``(p,a,b)=(3,2,5)`` is the tuple ``(3,2,5)`` with named components (several:
      ``(x,y) = (1,2), (2,1)`` or ``(x,y) \\in \\{...\\}``); against another naming of the same names the
      components are matched by name, as are assignments ``p=3, a=2, b=5``. Against an unnamed tuple (or
      an unnamed answer against a named reference) the names are placed in the order the problem declares
      (`declared_order`, `problem`): ``(x,n,y)=(2,\\frac12,\\frac94)`` for ``(2,\\frac12,\\frac94)`` of a
      problem asking for ``(n, x, y)`` is different, ``(a,b,p)=(2,5,3)`` for ``(3,2,5)`` asked as ``(p,a,b)``
      is equal. Without a declared order: equal only when every order of the names gives equal, different
      when every order gives different, else unsettled (never accepted on the answer's own order).
    """
    a, g = _shape(answer), _shape(gold)
    if a is None or g is None:
        return None
    for one, other in ((a, g), (g, a)):      # a single x = 5: a solution list against a list only
        if one.var and not one.rules and not one.collection and other.collection:
            one.rules.add("solution-list")
    if not (a.rules or g.rules):
        return None
    rule = "+".join(sorted(a.rules | g.rules))
    if a.var and g.var and a.var != g.var:
        return Outcome(UNSETTLED, rule, f"solutions for different variables: {a.var} and {g.var}")
    a_items, g_items = a.items, g.items
    if a.names and g.names:
        if set(a.names) < set(g.names) or set(a.names) > set(g.names):
            return Outcome(MISMATCH, rule, f"components {sorted(set(a.names) ^ set(g.names))} missing or extra")
        if set(a.names) != set(g.names):
            return Outcome(UNSETTLED, rule, f"differently named components: {a.names} and {g.names}")
        if not (a.ordered or g.ordered):
            return None
        a_items = _reorder(a.items, a.names, g.names)
        if a_items is None:
            return Outcome(UNSETTLED, rule, "named components that cannot be matched")
    elif a.names or g.names:
        placed = _named_against_unnamed(a, g, rule, problem)
        if placed is not None:
            return placed
        if not (a.ordered and g.ordered):
            return None       # assignments against something other than tuples: the structure rules read them
    a_nodes = [build(i) for i in a_items]
    g_nodes = [build(i) for i in g_items]
    if any(n.kind == "opaque" for n in a_nodes + g_nodes):
        return Outcome(UNSETTLED, rule, "an item the rules cannot read")
    if not a.collection and not g.collection and len(a_nodes) == len(g_nodes) == 1:
        outcome = nodes(a_nodes[0], g_nodes[0])
    else:
        outcome = _as_sets(a_nodes, g_nodes)
    return Outcome(outcome.grade, rule, outcome.detail)


# ---------------------------------------------------------------- relations, intervals, unions

@dataclass
class _RealSet:
    var: str | None
    readings: list[Any]            # one set, or two when a comma list of inequalities is ambiguous
    relational: bool               # an inequality, an interval, a union or R is involved
    tuple_like: bool = False


def _number(node: Node) -> Any | None:
    import sympy

    if node.kind != "expr" or node.value.free_symbols:
        return None
    value = node.value
    if value in (sympy.oo, -sympy.oo) or value.is_real:
        return value
    return None


def _relation_piece(item: str) -> tuple[str, Any, bool] | None:
    """A relation in one variable (``x \\leq 0``, ``-6 \\leq x \\leq 5``, ``|x| < 2``, ``x = 5``,
    ``x \\ne -3``) as (variable, set of real solutions, is an inequality)."""
    import sympy

    try:
        tokens = tokenize(item)
    except ParseError:
        return None
    chain, ops = relation_chain(tokens)
    if not ops:
        return None
    try:
        sides = [relation_side(side) for side in chain]      # \tau(-1) is one quantity, not a product
    except Exception:    # noqa: BLE001
        return None
    symbols = set().union(*(s.free_symbols for s in sides))
    if len(symbols) != 1:
        return None
    (x,) = symbols
    kinds = {"=": sympy.Eq, "<": sympy.Lt, ">": sympy.Gt, "<=": sympy.Le, ">=": sympy.Ge, "!=": sympy.Ne}
    result = sympy.S.Reals
    try:
        for op, left, right in zip(ops, sides, sides[1:], strict=False):
            solved = sympy.solveset(kinds[op](left, right), x, sympy.S.Reals)
            result = sympy.Intersection(result, solved)
    except Exception:    # noqa: BLE001
        return None
    if not _plain_set(result):
        return None
    return x.name, result, ops != ["="]


def _plain_set(value: Any) -> bool:
    """Intervals, finite sets of real numbers and unions of them (no condition or image sets)."""
    import sympy

    if value is sympy.S.EmptySet or value == sympy.S.Reals:
        return True
    if isinstance(value, sympy.Interval):
        return all(e.is_number for e in (value.start, value.end))
    if isinstance(value, sympy.FiniteSet):
        return all(e.is_number and e.is_real for e in value.args)
    if isinstance(value, sympy.Union):
        return all(_plain_set(p) for p in value.args)
    return False


def _set_piece(text: str, tuple_as_interval: bool) -> tuple[Any, bool] | None:
    """An interval, ``\\{...\\}``, a number, ``\\mathbb{R}``, unions and ``\\setminus`` of them:
    (sympy set, relational)."""
    import sympy

    text = text.strip()
    if _squash(text) == "\\mathbb{R}":
        return sympy.S.Reals, True
    minus = _top_split(text, "\\setminus")
    if len(minus) == 2:
        left, right = _set_piece(minus[0], True), _set_piece(minus[1], True)
        if left is None or right is None:
            return None
        return sympy.Complement(left[0], right[0]), True
    if len(minus) > 2:
        return None
    pieces = _top_split(text, "\\cup")
    if len(pieces) > 1:
        parts = [_set_piece(p, True) for p in pieces]          # (a, b) in a union is an interval
        if any(p is None for p in parts):
            return None
        return sympy.Union(*(p[0] for p in parts)), True
    node = build(text)
    if node.kind == "interval":
        ends = [_number(n) for n in node.items or []]
        if None in ends or len(ends) != 2:
            return None
        left_closed, right_closed = node.value
        return sympy.Interval(ends[0], ends[1], not left_closed, not right_closed), True
    if node.kind == "tuple" and tuple_as_interval and len(node.items or []) == 2:
        ends = [_number(n) for n in node.items or []]
        if None in ends or not ends[0] < ends[1]:
            return None
        return sympy.Interval.open(ends[0], ends[1]), True
    if node.kind == "set":
        values = [_number(n) for n in node.items or []]
        if None in values:
            return None
        return sympy.FiniteSet(*values), False
    value = _number(node)
    if value is not None and value not in (sympy.oo, -sympy.oo):
        return sympy.FiniteSet(value), False
    return None


#: the variable slot of ``… \\in S``: a variable or a labelled quantity (``P(0) \\in [-6, 5]``, see `_quantity_name`)
_QUANTITY = rf"{_VAR}(?:\s*\((?:[^()]|\([^()]*\))+\))?"


def _quantity_name(text: str) -> str | None:
    """The name of the variable slot `text` (``x``, ``a_1``, or a labelled quantity ``P(0)``, named like
    `sao_core.envs.exact_values.relation_side` names it, so that ``P(0) \\in [a, b]`` and ``a \\le P(0) \\le b``
    speak of the same quantity), or None when it is neither (``x(x-1)`` is a product)."""
    if _PLAIN.match(text.strip()):
        return text.strip()
    try:
        return applied_name(tokenize(text))
    except ParseError:
        return None


def real_set(text: str, *, tuple_as_interval: bool = False) -> _RealSet | None:
    """A set of real numbers described by `text` (see `relation_sets`), or None."""
    import sympy

    s = _prep(text)
    var = None
    m = re.fullmatch(rf"({_QUANTITY})\s*\\in(?![A-Za-z])\s*(.+)", s)
    if m:
        var, s = _quantity_name(m.group(1)), m.group(2).strip()
        if var is None:
            return None
    inner = _unwrap_set(s)
    if inner is not None:
        m = re.fullmatch(rf"({_VAR})\s*(?::|\\MID|\|)\s*(.+)", inner)
        if m:
            found = real_set(m.group(2))
            if found is None or (found.var and found.var != m.group(1)):
                return None
            return _RealSet(m.group(1), found.readings, True)
    items = _split_items(s)
    parsed = []
    relational = False
    for _, item in items:
        if any(op in item for op in _REL_TOKENS) or re.search(r"(?<![<>\\])=", item):
            piece = _relation_piece(item)
            if piece is None:
                return None
            name, solved, inequality = piece
            if var and name != var:
                return None
            var = name
            parsed.append((solved, "ineq" if inequality else "point"))
            relational = relational or inequality
        else:
            found = _set_piece(item, tuple_as_interval and len(items) == 1)
            if found is None:
                return None
            parsed.append((found[0], "piece" if found[1] else "point"))
            relational = relational or found[1]
    seps = {sep for sep, _ in items[1:]}
    sets = [p[0] for p in parsed]
    kinds = {p[1] for p in parsed}
    if len(sets) == 1:
        readings = sets
    elif "or" in seps and "and" in seps:
        return None
    elif seps == {"or"} or "ineq" not in kinds or ("point" in kinds and "and" not in seps):
        readings = [sympy.Union(*sets)]        # x = 5 or x = -3; x < 0, x = 1/2; n = 1, n >= 3
    elif "and" in seps:
        readings = [sympy.Intersection(*sets)]
    elif any(p == sympy.S.Reals for p in sets):  # x \in R, x != -3: R is a domain, not a piece
        readings = [sympy.Intersection(*sets)]
    else:                                      # x < -8/3, x != -4: a union or an intersection?
        readings = [sympy.Union(*sets), sympy.Intersection(*sets)]
    if not relational:
        return _RealSet(var, readings, False)
    if not all(_plain_set(r) for r in readings):
        return None
    return _RealSet(var, readings, True, tuple_like=build(s).kind == "tuple")


def _integer_in(value: Any) -> Any | None:
    """An integer in the set `value` (intervals, finite sets, unions), or None."""
    import sympy

    if isinstance(value, sympy.Union):
        for part in value.args:
            found = _integer_in(part)
            if found is not None:
                return found
        return None
    if isinstance(value, sympy.FiniteSet):
        return next((e for e in value.args if e.is_integer), None)
    if isinstance(value, sympy.Interval):
        start = value.start
        if start == -sympy.oo:
            return sympy.floor(value.end) - 1 if value.end != sympy.oo else sympy.Integer(0)
        n = sympy.ceiling(start)
        if n == start and value.left_open:
            n += 1
        return n if (n < value.end or (n == value.end and not value.right_open)) else None
    return None


def _prime_in(value: Any) -> Any | None:
    """A prime in the set `value` (intervals, finite sets, unions), or None (complete: the least prime
    from an interval's start is the one to try)."""
    import sympy

    if isinstance(value, sympy.Union):
        return next((p for p in (_prime_in(part) for part in value.args) if p is not None), None)
    if isinstance(value, sympy.FiniteSet):
        return next((e for e in value.args if e.is_integer and sympy.isprime(e)), None)
    if isinstance(value, sympy.Interval):
        start = max(sympy.ceiling(value.start) if value.start != -sympy.oo else 2, 2)
        p = sympy.Integer(sympy.nextprime(start - 1))
        inside = p > value.start or not value.left_open
        return p if inside and (p < value.end or (p == value.end and not value.right_open)) else None
    return None


def _point_in(value: Any) -> Any | None:
    """A real number in the set `value` (an integer when there is one), or None."""
    import sympy

    found = _integer_in(value)
    if found is not None or value is sympy.S.EmptySet:
        return found
    if isinstance(value, sympy.Union):
        return next((p for p in (_point_in(part) for part in value.args) if p is not None), None)
    if isinstance(value, sympy.FiniteSet):
        return value.args[0] if value.args else None
    if isinstance(value, sympy.Interval) and value.measure > 0:
        return (value.start + value.end) / 2      # finite: an interval with no integer is short
    return None


def _member_in(part: Any, domain: Domain, sure: bool) -> Any | None:
    """A member of the problem's `domain` in the set of reals `part` (`sure`: in the domain under every
    reading, else under its larger one), or None: an integer (a prime for primes, any real for reals)."""
    import sympy

    part = sympy.Intersection(part, domain.hull(sure))
    if not _plain_set(part):
        return None
    if domain.kind == "P":
        return _prime_in(part)
    return _point_in(part) if domain.kind == "R" else _integer_in(part)


def _compare_real_sets(a: Any, g: Any, domain: Domain | None = None) -> Outcome:
    """Two sets of reals: equal, different by a witness (an integer), or unsettled. With the problem's
    `domain` for the variable, see `_compare_on_domain`."""
    import sympy

    try:
        only_a, only_g = sympy.Complement(a, g), sympy.Complement(g, a)
    except Exception:    # noqa: BLE001
        return Outcome(UNSETTLED, "relation-interval", "the sets cannot be compared exactly")
    if only_a is sympy.S.EmptySet and only_g is sympy.S.EmptySet:
        return Outcome(MATCH, "relation-interval", "the same set of real numbers")
    if not (_plain_set(only_a) and _plain_set(only_g)):
        return Outcome(UNSETTLED, "relation-interval", "the sets cannot be compared exactly")
    if domain is not None:
        return _compare_on_domain(only_a, only_g, domain)
    for side, part in (("answer", only_a), ("reference", only_g)):
        n = _integer_in(part)
        if n is not None:
            return Outcome(MISMATCH, "relation-interval", f"{n} is in the {side}'s set only")
    return Outcome(UNSETTLED, "relation-interval", "the sets differ only at non-integers (the same set of "
                   "integers: it depends on the problem)")


def _only_implicitly_outside(part: Any, domain: Domain) -> bool:
    """Is what `part` (a difference of the two sets) has outside the problem's `domain` only what a
    description leaves implicit: all of the reals below the domain or none of them (``n \\ne 2`` over the
    positive integers holds every n < 1), and, for integers and primes, no listed point that is not a
    member? A bounded piece below the domain (``-1 < c < 1`` for positive c) or a listed non-member
    (``n = -5``) is a claim about values the problem excludes: not proof of either verdict."""
    import sympy

    hull = domain.hull(sure=False)
    below = sympy.Complement(part, hull)
    if below is not sympy.S.EmptySet and below != sympy.Complement(sympy.S.Reals, hull):
        return False
    if domain.kind not in ("Z", "P"):
        return True
    inside = sympy.Intersection(part, hull)
    pieces = inside.args if isinstance(inside, sympy.Union) else (inside,)
    return not any(isinstance(piece, sympy.FiniteSet) for piece in pieces)


def _compare_on_domain(only_a: Any, only_g: Any, domain: Domain) -> Outcome:
    """The differences of two sets of reals (`only_a`: in the answer's only) judged on the problem's
    `domain` (`declared_domain`): different when a member of the domain (under every reading: ℕ from 1;
    a prime for primes, any real for reals) is in one set only; equal when no member of the domain (in
    its larger reading: ℕ from 0) is, and what differs outside it is only implicit
    (`_only_implicitly_outside`: ``n \\ne 2`` = ``n = 1, n \\geq 3`` over the positive integers); else
    unsettled. With a bound only (the type unsaid) the sets must agree at every real above it."""
    for side, part in (("answer", only_a), ("reference", only_g)):
        n = _member_in(part, domain, sure=True)
        if n is not None:
            return Outcome(MISMATCH, "relation-interval", f"{n} is in the {side}'s set only (a member of the "
                           "problem's domain)")
    kind = domain.kind or "R"          # a bare bound: the members may be any reals above it
    larger = replace(domain, kind=kind, zero_maybe=False, least=0 if domain.zero_maybe else domain.least)
    if any(_member_in(part, larger, sure=True) is not None for part in (only_a, only_g)):
        reason = "0 (is it a natural number?)" if domain.zero_maybe else "non-integers (is the variable an integer?)"
        return Outcome(UNSETTLED, "relation-interval", f"the sets differ only at {reason}")
    if not all(_only_implicitly_outside(part, domain) for part in (only_a, only_g)):
        return Outcome(UNSETTLED, "relation-interval", "a set names values outside the problem's domain (the "
                       "judge decides whether that is wrong)")
    return Outcome(MATCH, "relation-interval", "the same members of the problem's domain (the sets differ "
                   "only outside it)")


def relation_sets(answer: str, gold: str, problem: str | None = None) -> Outcome | None:
    """Rule ``relation-interval``: relations in one variable (``x \\le 0``, ``-6 \\le x \\le 5``,
    ``x \\ne -3``, ``|x| < 2``), intervals, ``\\{...\\}``, ``\\mathbb{R}``, unions, ``\\setminus``,
    ``x \\in ...``, ``\\{x : ...\\}``, joined by ``or``/``and``/commas, as sets of reals (sympy's
    ``solveset``), when an inequality, interval, union or R is involved. Joins: ``or`` is a union;
    ``and`` an intersection (of equalities: a union); a comma list of inequalities is read both ways and
    settled only when both readings agree. Equal when the sets are equal; different when an integer is
    in one set only; else unsettled (``x > 1`` and ``x \\geq 2`` are the same integers). Variables must
    be the same when both sides name one; an answer ``(a, b)`` is the open interval against a relation.
    The problem's domain for the variable (`declared_domain`) limits the comparison (`_compare_real_sets`)."""
    g = real_set(gold)
    if g is None:
        return None
    a = real_set(answer, tuple_as_interval=g.relational and not g.tuple_like)
    if a is None or not (a.relational or g.relational):
        return None
    if a.var and g.var and a.var != g.var:
        return Outcome(UNSETTLED, "relation-interval", f"sets of different variables: {a.var} and {g.var}")
    domain = declared_domain(problem, a.var or g.var)
    results = [_compare_real_sets(x, y, domain) for x in a.readings for y in g.readings]
    if len({r.grade for r in results}) == 1:
        return results[0]
    return Outcome(UNSETTLED, "relation-interval", "a comma list of inequalities read as a union and as an "
                   "intersection gives different verdicts")


def structural(answer: str, gold: str, compare: Compare, *, problem: str | None = None) -> Outcome | None:
    """The structural rules in order (degrees, sets of integers, value lists, relations); None when none
    applies. An unsettled rule lets the later ones try. `compare` is the whole comparison
    (`sao_core.envs.exact.compare`), which the degrees rule applies to the rewritten texts. `problem` (the
    problem statement, optional) gives named tuples their declared order and variables their domain."""
    unsettled = None
    rules = (lambda a, g: degrees(a, g, compare), lambda a, g: int_sets(a, g, problem),
             lambda a, g: value_lists(a, g, problem), lambda a, g: relation_sets(a, g, problem))
    for rule in rules:
        try:
            outcome = rule(answer, gold)
        except Exception:    # noqa: BLE001  sympy raises many kinds on odd input: the rule does not apply
            outcome = None
        if outcome is None:
            continue
        if outcome.grade != UNSETTLED or outcome.final:
            return outcome
        unsettled = unsettled or outcome
    return unsettled
