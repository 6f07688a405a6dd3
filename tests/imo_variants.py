"""Generated answer variants of the real IMO-AnswerBench gold answers, for the exact-rule tests
(tests/eval/test_eval_imo_exact.py, tests/eval/test_eval_imo_structural.py): `wrong_variants` (each must not be
accepted) and `equivalent_forms` (each is the same answer written differently); `structural_variants`
gives both for the structural forms (relations for intervals, solution lists, plus-minus, named
tuples, congruences, degrees, factorial identities, prose sets as symbols)."""

from __future__ import annotations

import re
from fractions import Fraction

import sympy

from sao_core.envs.exact import build, clean, int_set, real_set
from sao_core.eval.graders import is_prose

_INT = re.compile(r"(?<![\d.])\d+(?![\d.])")


def bare(gold: str) -> str:
    """The gold without surrounding whitespace, ``$`` and a final full stop."""
    text = gold.strip().rstrip(".").strip()
    if text.startswith("$") and text.endswith("$") and text.count("$") == 2:
        text = text[1:-1].strip()
    return text


def _top_items(text: str) -> list[str] | None:
    """The top-level comma-separated items of a bare list gold, else None."""
    depth, items, current = 0, [], ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    items.append(current.strip())
    return items if len(items) > 1 else None


def wrong_variants(records: list[dict]) -> list[tuple[str, str, str]]:
    """(gold, wrong answer, kind) for every record."""
    out: list[tuple[str, str, str]] = []
    golds = [r["answer"] for r in records]
    for i, gold in enumerate(golds):
        text = bare(gold)
        prose = is_prose(gold)
        numbers = list(_INT.finditer(text))
        for m in numbers[:1] + numbers[-1:] if numbers else []:
            value = int(m.group(0))
            for delta in (1, -1):
                if value + delta < 0:
                    continue
                out.append((gold, text[:m.start()] + str(value + delta) + text[m.end():], f"{delta:+d} on a number"))
        node = build(text)
        if not prose and node.kind in ("expr",) and node.value != 0:
            out.append((gold, text[1:] if text.startswith("-") else f"-({text})", "flipped sign"))
            value = node.value
            if value.is_number and value != 0 and abs(float(value)) < 1e9:
                out.append((gold, f"{float(value) + 1e-7:.9f}", "nearby decimal"))
                if not value.is_Rational:
                    out.append((gold, f"{float(value):.8f}", "rounded decimal"))
        items = _top_items(text)
        if not prose and node.kind in ("list", "set") and items:
            out.append((gold, ", ".join(items[:-1]), "dropped element"))
            extra = "99991"
            found = real_set(text)
            if found is not None and found.relational and any(sympy.Integer(99991) in r for r in found.readings):
                extra = "-99991"                 # n = 1, n >= 3 already holds 99991: add a non-member
            out.append((gold, ", ".join(items + [extra]), "added element"))
        if not prose and node.kind == "tuple":
            inner = _top_items(text[1:-1].strip()) or []
            if len(inner) > 1 and inner[0] != inner[1]:
                out.append((gold, "(" + ", ".join([inner[1], inner[0], *inner[2:]]) + ")", "permuted tuple"))
        for step in (1, 7):
            other = golds[(i + step) % len(golds)]
            if clean(other) != clean(gold):
                out.append((gold, bare(other), "another problem's answer"))
    out.extend((g, a, k) for g, a, k, wrong in structural_variants(records) if wrong)
    # a variant equal to its gold by construction (e.g. "-(0)") is no trap
    return [(g, a, k) for g, a, k in out if clean(a) != clean(g)]


def _thousands(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


def equivalent_forms(records: list[dict]) -> list[tuple[str, str, str]]:
    """(gold, equivalent answer, kind) for every record."""
    out: list[tuple[str, str, str]] = []
    for r in records:
        gold = r["answer"]
        text = bare(gold)
        prose = is_prose(gold)
        out.append((gold, f"${text}$.", "$...$ and a full stop"))
        out.append((gold, f"\\({text}\\)", "\\(...\\)"))
        if prose:
            lowered = re.sub(r"(?<![\\A-Za-z$])[A-Za-z]{2,}(?![A-Za-z])", lambda m: m.group(0).lower(), text) \
                if "$" not in text else text
            if re.match(r"[A-Za-z]{2,}", lowered):     # a one-letter first word is a symbol: its case stays
                out.append((gold, lowered[:1].upper() + lowered[1:], "capitalised prose"))
            out.append((gold, lowered + ".", "lower-case prose with a full stop"))
            continue
        if "\\frac" in text:
            out.append((gold, text.replace("\\frac", "\\dfrac"), "\\dfrac"))
        if re.search(r"\\cdot(?![A-Za-z])", text):       # \cdot, not the \cdots ellipsis
            out.append((gold, re.sub(r"\\cdot(?![A-Za-z])", lambda _: "\\times", text), "\\times for \\cdot"))
        node = build(text)
        if node.kind == "expr":
            out.append((gold, f"x = {text}", "x = v"))
            out.append((gold, re.sub(r"([+\-])", r" \1 ", text).strip(), "spaces around + and -"))
            if re.fullmatch(r"\d+", text) and int(text) >= 1000:
                n = int(text)
                for sep in (",", "{,}", "\\,", " "):
                    out.append((gold, _thousands(n, sep), f"thousands separator {sep!r}"))
            if re.fullmatch(r"-?\d*\.\d+", text):
                f = Fraction(text)
                out.append((gold, f"\\frac{{{f.numerator}}}{{{f.denominator}}}", "fraction for the decimal"))
                out.append((gold, text + "0", "a trailing zero"))
            if re.fullmatch(r"-?\d+", text):
                out.append((gold, f"\\text{{{text}}}", "\\text{}"))
        items = _top_items(text)
        if node.kind in ("list", "set") and items:
            out.append((gold, ", ".join(reversed(items)), "reversed list"))
            out.append((gold, "\\{" + ", ".join(reversed(items)) + "\\}", "as a set"))
        if node.kind == "set" and text.startswith("\\{"):
            inner = _top_items(text[2:-2]) or []
            if inner:
                out.append((gold, "\\{" + ", ".join(reversed(inner)) + "\\}", "reordered set"))
        if node.kind == "tuple":
            out.append((gold, "\\left" + text[0] + " " + text[1:-1] + " \\right" + text[-1], "\\left( \\right)"))
        if node.kind == "label":
            out.append((gold, text.replace("=", " = ", 1), "spaces around ="))
    out.extend((g, a, k) for g, a, k, wrong in structural_variants(records) if not wrong)
    return out


# ------------------------------------------------------------------ structural forms (issue: structural equivalence)

Variant = tuple[str, str, str, bool]        # (gold, answer, kind, wrong)
GE, LE = "\\ge", "\\le"


def _tex(value) -> str:
    return sympy.latex(value)


def _relation_text(pieces: list, var: str = "x") -> str:
    """A sympy set (intervals and points) as relations in `var` joined by "or"."""
    parts = []
    for piece in pieces:
        if isinstance(piece, sympy.FiniteSet):
            parts.extend(f"{var} = {_tex(v)}" for v in piece.args)
            continue
        lo, hi = piece.start, piece.end
        left = "<" if piece.left_open else LE
        right = "<" if piece.right_open else LE
        if lo == -sympy.oo and hi == sympy.oo:
            parts.append(f"{var} \\in \\mathbb{{R}}")
        elif lo == -sympy.oo:
            parts.append(f"{var} {right} {_tex(hi)}")
        elif hi == sympy.oo:
            parts.append(f"{var} {'>' if piece.left_open else GE} {_tex(lo)}")
        else:
            parts.append(f"{_tex(lo)} {left} {var} {right} {_tex(hi)}")
    return " \\text{ or } ".join(parts)


def _relation_variants(gold: str, text: str) -> list[Variant]:
    """Relations for intervals and unions (and back): the same set; one endpoint moved by 1; an integer
    endpoint strict for non-strict or back."""
    found = real_set(text)
    if found is None or not found.relational or len(found.readings) != 1:
        return []
    value = found.readings[0]
    pieces = list(value.args) if isinstance(value, sympy.Union) else [value]
    var = found.var or "x"
    out = [(gold, _relation_text(pieces, var), "relation for the set", False)]
    if found.var is None:
        out.append((gold, f"{var} \\in {text}", "x in the set", False))
    for k, piece in enumerate(pieces):
        if not isinstance(piece, sympy.Interval):
            continue
        for end in ("start", "end"):
            at = getattr(piece, end)
            if at in (sympy.oo, -sympy.oo):
                continue
            for delta in (1, -1):
                ends = {"start": piece.start, "end": piece.end}
                ends[end] = at + delta
                if ends["start"] < ends["end"]:
                    moved = sympy.Interval(ends["start"], ends["end"], piece.left_open, piece.right_open)
                    out.append((gold, _relation_text(pieces[:k] + [moved] + pieces[k + 1:], var),
                                "relation with a wrong endpoint", True))
            if at.is_integer:
                opens = [piece.left_open, piece.right_open]
                opens[end == "end"] = not opens[end == "end"]
                flipped = sympy.Interval(piece.start, piece.end, *opens)
                out.append((gold, _relation_text(pieces[:k] + [flipped] + pieces[k + 1:], var),
                            "relation strict for non-strict (or back)", True))
    return out


def _numbers(node) -> list | None:
    items = node.items if node.kind in ("list", "set") else [node] if node.kind == "expr" else None
    if not items or any(i.kind != "expr" or not i.value.is_number for i in items):
        return None
    return [i.value for i in items]


def _list_variants(gold: str, node) -> list[Variant]:
    """Solution lists (``x = v, ...``, ``x \\in \\{...\\}``) and plus-minus forms of number lists; one
    value wrong, one missing, a spurious ± root."""
    values = _numbers(node)
    if values is None:
        return []
    tex = [_tex(v) for v in values]
    out: list[Variant] = []
    if len(values) > 1:
        out.append((gold, ", ".join(f"x = {t}" for t in tex), "solution list x = v", False))
        out.append((gold, "x \\in \\{" + ", ".join(reversed(tex)) + "\\}", "x in a set", False))
        if values[0] + 1 not in values:
            out.append((gold, ", ".join(f"x = {t}" for t in [_tex(values[0] + 1)] + tex[1:]),
                        "solution list with a wrong value", True))
        out.append((gold, ", ".join(f"x = {t}" for t in tex[:-1]), "solution list missing a root", True))
        positive = [v for v in values if v.is_positive and -v in values]
        if positive:
            rest = [_tex(v) for v in values if v not in positive and -v not in positive]
            out.append((gold, ", ".join(rest + [f"\\pm {_tex(v)}" for v in positive]), "plus-minus for a pair",
                        False))
            out.append((gold, ", ".join(rest + [f"\\pm {_tex(v + 1)}" for v in positive]),
                        "plus-minus with a wrong value", True))
    elif values[0] != 0 and values[0].is_real:
        out.append((gold, f"\\pm {_tex(abs(values[0]))}", "plus-minus adds a spurious root", True))
        out.append((gold, f"x = {tex[0]}, x = {_tex(values[0] + 1)}", "solution list adds a root", True))
    return out


def _tuple_variants(gold: str, node, problem: str = "") -> list[Variant]:
    """Named tuples ``(n, x, y) = (...)`` with the names in the order the problem declares them (the first
    tuple of letters of the gold's length in its text; none: no named forms, a name order would be a guess);
    rotated values; the last value off by one. Grade them with the record's problem text."""
    if node.kind != "tuple" or len(node.items or []) > 6:
        return []
    parts = [i.text for i in node.items]
    declared = [m.group(1) for m in re.finditer(r"(?<![A-Za-z0-9}])\(\s*([A-Za-z](?:\s*,\s*[A-Za-z])+)\s*\)",
                                                problem.replace("$", " "))
                if len(m.group(1).split(",")) == len(parts)]
    if not declared:
        return []
    head = "(" + ", ".join(n.strip() for n in declared[0].split(",")) + ")"
    out = [(gold, f"{head} = ({', '.join(parts)})", "named tuple", False)]
    rotated = parts[1:] + parts[:1]
    if rotated != parts:
        out.append((gold, f"{head} = ({', '.join(rotated)})", "named tuple rotated", True))
    last = node.items[-1].value
    if last.is_number:
        out.append((gold, f"{head} = ({', '.join(parts[:-1] + [_tex(last + 1)])})", "named tuple, a wrong value",
                    True))
    return out


def _residues(var: str, residues, modulus: int) -> str:
    return f"{var} \\equiv {', '.join(str(r) for r in sorted(residues))} \\pmod{{{modulus}}}"


def _class_variants(gold: str, text: str) -> list[Variant]:
    """Sets of integers (progressions, congruences, prose sets) as congruences / powers / symbols, and
    wrong ones: a shifted residue, a doubled modulus, 1 missing, another base, multiples for powers."""
    found = int_set(text)
    if found is None or not found.strong:
        return []
    modulus, residues, extra, excluded, powers, primes = found.canonical()
    if extra or excluded or primes or found.domain not in (None, "Z+"):
        return []
    var = found.var or "n"
    out: list[Variant] = []
    if residues and not powers and modulus > 1:
        out.append((gold, _residues(var, residues, modulus), "congruence for the class", False))
        shifted = {(r + 1) % modulus for r in residues}
        if shifted != set(residues):
            out.append((gold, _residues(var, shifted, modulus), "congruence with a wrong residue", True))
        out.append((gold, _residues(var, residues, 2 * modulus), "congruence with a doubled modulus", True))
    elif residues and not powers:
        if found.domain == "Z+":
            out.append((gold, "\\mathbb{Z}^+", "positive integers as a symbol", False))
        out.append((gold, f"{var} \\equiv 1 \\pmod 2", "odd numbers for all", True))
        out.append((gold, "\\mathbb{Z}_{\\geq 2}", "1 missing", True))
    elif powers and not residues and len(powers) == 1:
        (base, least), = powers
        out.append((gold, f"{var} = {base}^k, k \\ge {least}", "a power with its range", False))
        out.append((gold, f"{base}^k, k \\ge {least + 1}", "powers without the least one", True))
        out.append((gold, f"{base + 1}^k", "powers of another base", True))
        out.append((gold, f"{var} \\equiv 0 \\pmod{{{base}}}", "multiples for powers", True))
    elif not residues and not powers:
        out.append((gold, "\\emptyset", "the empty set", False))
        out.append((gold, "\\{1\\}", "one element for none", True))
    return out


def _degree_variants(gold: str, text: str, category: str) -> list[Variant]:
    """Geometry answers in degrees with a degree sign, and one degree off."""
    if category != "Geometry":
        return []
    if re.fullmatch(r"\d+", text) and 0 < int(text) <= 360:
        v = int(text)
        return [(gold, f"{v}^\\circ", "degree sign", False), (gold, f"{v}^{{\\circ}}", "braced degree sign", False),
                (gold, f"{v + 1}^\\circ", "off by one degree", True), (gold, f"{v - 1}°", "off by one degree", True)]
    if "180" in text and "\\alpha" in text:
        return [(gold, text.replace("180", "180^\\circ"), "degree sign", False),
                (gold, text.replace("180", "90^\\circ"), "degree sign on a wrong constant", True)]
    return []


def _factorial_variants(gold: str, text: str) -> list[Variant]:
    """Factorials, double factorials and binomials as ratios of factorials, and wrong ratios."""
    m = re.fullmatch(r"\((.+)\)!!", text)
    if m:
        e = m.group(1)
        return [(gold, f"\\frac{{({e}+1)!}}{{({e}+1)!!}}", "double factorial as a ratio", False),
                (gold, f"\\frac{{({e}+1)!}}{{({e}-1)!!}}", "a wrong double-factorial ratio", True)]
    m = re.fullmatch(r"\((.+)\)!", text)
    if m:
        e = m.group(1)
        return [(gold, f"\\frac{{({e}+1)!}}{{{e}+1}}", "factorial as a ratio", False),
                (gold, f"\\frac{{({e}+1)!}}{{{e}}}", "a wrong factorial ratio", True)]
    m = re.fullmatch(r"\\binom\{(.+?)\}\{(.+?)\}(\^2)?", text)
    if m:
        top, bottom, square = m.group(1), m.group(2), m.group(3) or ""
        good = f"\\left(\\frac{{({top})!}}{{({bottom})! \\, ({top}-{bottom})!}}\\right){square}"
        bad = f"\\left(\\frac{{({top})!}}{{({bottom})! \\, ({top}-{bottom}+1)!}}\\right){square}"
        return [(gold, good, "binomial as factorials", False), (gold, bad, "a wrong binomial identity", True)]
    return []


def problems_by_gold(records: list[dict]) -> dict[str, str]:
    """The problem text of each gold answer that belongs to one record only (a generated variant is graded
    with its problem: named tuples take the problem's order of the names, variables its domain)."""
    count: dict[str, int] = {}
    for r in records:
        count[r["answer"]] = count.get(r["answer"], 0) + 1
    return {r["answer"]: r["problem"] for r in records if count[r["answer"]] == 1}


def structural_variants(records: list[dict]) -> list[Variant]:
    """(gold, answer, kind, wrong) in the structural forms, for every record where they apply."""
    out: list[Variant] = []
    for r in records:
        gold = r["answer"]
        text = bare(gold)
        out.extend(_class_variants(gold, text))
        if is_prose(gold):
            continue
        node = build(text)
        out.extend(_relation_variants(gold, text))
        out.extend(_list_variants(gold, node))
        out.extend(_tuple_variants(gold, node, r.get("problem", "")))
        out.extend(_degree_variants(gold, text, r.get("category", "")))
        out.extend(_factorial_variants(gold, text))
    seen: set[tuple[str, str]] = set()
    unique = []
    for g, a, k, wrong in out:
        if (g, a) not in seen and clean(a) != clean(g):
            seen.add((g, a))
            unique.append((g, a, k, wrong))
    return unique
