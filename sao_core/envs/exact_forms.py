"""The structural rules of the exact answer comparison (`sao_core.envs.exact` documents them and calls
`structural` from `compare`): degrees, sets of integers (prose, symbols, residue classes), value lists (±,
solution lists, named tuples) and sets of reals (relations, intervals, unions)."""

from __future__ import annotations

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
    build,
    clean,
    nodes,
    parse_expression,
    relation_chain,
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


def _split_items(text: str) -> list[tuple[str, str]]:
    """The top-level items of `text` (outside brackets), each with the connective before it:
    ``""`` (first), ``","``, ``"and"`` or ``"or"``."""
    out: list[tuple[str, str]] = []
    depth, start, sep, i = 0, 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            m = _CONN_RE.match(text, i)
            if m and not (text[i] == "\\" and m.group(3) is None):
                out.append((sep, text[start:i].strip()))
                word = m.group(1) or m.group(2) or m.group(3) or ","
                sep = {"land": "and", "wedge": "and", "lor": "or", "vee": "or"}.get(word, word)
                sep = "," if sep == ";" else sep
                i = start = m.end()
                continue
        i += 1
    out.append((sep, text[start:].strip()))
    return out


def _top_split(text: str, sep: str) -> list[str]:
    """`text` split at the top-level occurrences of the command `sep` (``\\cup``, ``\\setminus``)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i) and not text[i + len(sep):i + len(sep) + 1].isalpha():
            parts.append(text[start:i].strip())
            i = start = i + len(sep)
            continue
        i += 1
    parts.append(text[start:].strip())
    return parts


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
    ``\\pi`` is read as 180 (``\\pi - 2\\alpha`` for ``180 - 2\\alpha``) is unsettled, not different."""
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


def int_sets(answer: str, gold: str) -> Outcome | None:
    """Rules ``prose-set`` and ``congruence-progression``: both sides read by `int_set`, at least one a
    set description (not a plain list or a bare ``4k+3``). Equal when the canonical forms (residues
    mod the least period, extra and excluded members, powers, primes) are the same and the declared
    domains agree (or one is the problem's); different when an integer from 1 to 400 (or from -400 when
    both are all of ``\\mathbb{Z}``) is in one and not the other; else unsettled (``\\mathbb{Z}`` and
    ``\\mathbb{Z}^+`` with the same classes, prose on both sides)."""
    a, g = int_set(answer), int_set(gold)
    if a is None or g is None or not (a.strong or g.strong):
        return None
    rule = "prose-set" if "prose-set" in (a.source, g.source) else "congruence-progression"
    if _wordy(answer) and _wordy(gold):
        return Outcome(UNSETTLED, rule, "both are worded in prose (the judge compares wordings)")
    if a.var and g.var and a.var != g.var:
        return Outcome(UNSETTLED, rule, f"sets of different variables: {a.var} and {g.var}")
    if a.canonical() == g.canonical():
        if a.param and a.param == g.param and a.form != g.form:
            return Outcome(UNSETTLED, rule, f"the same class, but {a.param} may be given: as expressions in "
                           f"{a.param} they differ", final=True)
        if a.domain and g.domain and a.domain != g.domain:
            return Outcome(UNSETTLED, rule, f"the same classes over different domains: {a.domain} and {g.domain}")
        if not g.strong and g.param:
            return Outcome(UNSETTLED, rule, f"the reference {gold.strip()} may be a value in a given {g.param}, "
                           "not a set", final=True)
        return Outcome(MATCH, rule, "the same set of integers")
    low = -400 if a.domain == g.domain == "Z" else 1
    for n in range(1, 401) if low == 1 else sorted(range(low, 401), key=abs):
        if a.has(n) != g.has(n):
            return Outcome(MISMATCH, rule, f"{n} is in {'the answer' if a.has(n) else 'the reference'} only")
    return Outcome(UNSETTLED, rule, "different descriptions, no difference found among small integers")


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


def value_lists(answer: str, gold: str) -> Outcome | None:
    """Rules ``plus-minus``, ``solution-list`` and ``named-tuple``: the answer and the reference rewritten
    as lists of values, then compared by the structure rules (sets of values; tuples in order).

    - ``plus-minus``: an item with one ``\\pm`` (or ``\\mp``) is two items (``0, \\pm\\frac23`` is
      ``0, \\frac23, -\\frac23``); two or more in one item are not read.
    - ``solution-list``: ``x=5, x=-3``, ``x = 5 or x = -3``, ``x = 5, -3``, ``x_1 = 5, x_2 = -3`` and
      ``x \\in \\{5, -3\\}`` are the values ``5, -3`` (one variable; two different variables: unsettled).
    - ``named-tuple``: ``(p,a,b)=(3,2,5)`` is the tuple ``(3,2,5)`` with named components (several:
      ``(x,y) = (1,2), (2,1)`` or ``(x,y) \\in \\{...\\}``); against another naming of the same names the
      components are matched by name. Assignments ``p=3, a=2, b=5`` are matched by name against a named
      tuple; against an unnamed tuple their order is unknown: different when the values cannot be the
      tuple's in any order, else unsettled.
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
    elif (a.names and not a.ordered) or (g.names and not g.ordered):
        named, other = (a, g) if a.names else (g, a)
        values = [p for _, p in _split_items(named.items[0][1:-1])]
        if len(other.items) != 1 or build(other.items[0]).kind != "tuple":
            return None
        tuple_items = [p for _, p in _split_items(other.items[0].strip()[1:-1])]
        if len(tuple_items) != len(values):
            return Outcome(MISMATCH, rule, f"{len(values)} named values, the tuple has {len(tuple_items)}")
        outcome = _as_sets([build(v) for v in values], [build(v) for v in tuple_items])
        if outcome.grade == MISMATCH:
            return Outcome(MISMATCH, rule, f"the named values are not the tuple's in any order: {outcome.detail}")
        return Outcome(UNSETTLED, rule, "named values against an unnamed tuple: the order of the names is unknown")
    a_nodes = [build(i) for i in a_items]
    g_nodes = [build(i) for i in g_items]
    if any(n.kind == "opaque" for n in a_nodes + g_nodes):
        return Outcome(UNSETTLED, rule, "an item the rules cannot read")
    if not a.collection and not g.collection and len(a_nodes) == len(g_nodes) == 1:
        outcome = nodes(a_nodes[0], g_nodes[0])
        if outcome.grade == MISMATCH and bool(a.names) != bool(g.names) and a_nodes[0].kind == g_nodes[0].kind == "tuple":
            # (a,b,p) = (2,5,3) for (3,2,5): the names may follow another order than the problem's
            anyhow = _as_sets(a_nodes[0].items or [], g_nodes[0].items or [])
            if anyhow.grade != MISMATCH and len(a_nodes[0].items or []) == len(g_nodes[0].items or []):
                return Outcome(UNSETTLED, rule, "named components in another order than the unnamed reference: "
                               "the problem's order of the names decides")
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
        sides = [parse_expression(" ".join(side)) for side in chain]
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


def real_set(text: str, *, tuple_as_interval: bool = False) -> _RealSet | None:
    """A set of real numbers described by `text` (see `relation_sets`), or None."""
    import sympy

    s = _prep(text)
    var = None
    m = re.fullmatch(rf"({_VAR})\s*\\in(?![A-Za-z])\s*(.+)", s)
    if m:
        var, s = m.group(1), m.group(2).strip()
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


def _compare_real_sets(a: Any, g: Any) -> Outcome:
    import sympy

    try:
        only_a, only_g = sympy.Complement(a, g), sympy.Complement(g, a)
    except Exception:    # noqa: BLE001
        return Outcome(UNSETTLED, "relation-interval", "the sets cannot be compared exactly")
    if only_a is sympy.S.EmptySet and only_g is sympy.S.EmptySet:
        return Outcome(MATCH, "relation-interval", "the same set of real numbers")
    if not (_plain_set(only_a) and _plain_set(only_g)):
        return Outcome(UNSETTLED, "relation-interval", "the sets cannot be compared exactly")
    for side, part in (("answer", only_a), ("reference", only_g)):
        n = _integer_in(part)
        if n is not None:
            return Outcome(MISMATCH, "relation-interval", f"{n} is in the {side}'s set only")
    return Outcome(UNSETTLED, "relation-interval", "the sets differ only at non-integers (the same set of "
                   "integers: it depends on the problem)")


def relation_sets(answer: str, gold: str) -> Outcome | None:
    """Rule ``relation-interval``: relations in one variable (``x \\le 0``, ``-6 \\le x \\le 5``,
    ``x \\ne -3``, ``|x| < 2``), intervals, ``\\{...\\}``, ``\\mathbb{R}``, unions, ``\\setminus``,
    ``x \\in ...``, ``\\{x : ...\\}``, joined by ``or``/``and``/commas, as sets of reals (sympy's
    ``solveset``), when an inequality, interval, union or R is involved. Joins: ``or`` is a union;
    ``and`` an intersection (of equalities: a union); a comma list of inequalities is read both ways and
    settled only when both readings agree. Equal when the sets are equal; different when an integer is
    in one set only; else unsettled (``x > 1`` and ``x \\geq 2`` are the same integers). Variables must
    be the same when both sides name one; an answer ``(a, b)`` is the open interval against a relation."""
    g = real_set(gold)
    if g is None:
        return None
    a = real_set(answer, tuple_as_interval=g.relational and not g.tuple_like)
    if a is None or not (a.relational or g.relational):
        return None
    if a.var and g.var and a.var != g.var:
        return Outcome(UNSETTLED, "relation-interval", f"sets of different variables: {a.var} and {g.var}")
    results = [_compare_real_sets(x, y) for x in a.readings for y in g.readings]
    if len({r.grade for r in results}) == 1:
        return results[0]
    return Outcome(UNSETTLED, "relation-interval", "a comma list of inequalities read as a union and as an "
                   "intersection gives different verdicts")


def structural(answer: str, gold: str, compare: Compare) -> Outcome | None:
    """The structural rules in order (degrees, sets of integers, value lists, relations); None when none
    applies. An unsettled rule lets the later ones try. `compare` is the whole comparison
    (`sao_core.envs.exact.compare`), which the degrees rule applies to the rewritten texts."""
    unsettled = None
    rules = (lambda a, g: degrees(a, g, compare), int_sets, value_lists, relation_sets)
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
