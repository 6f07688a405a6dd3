"""Generated answer variants of the real IMO-AnswerBench gold answers, for the exact-rule tests
(tests/test_eval_imo_exact.py): `wrong_variants` (each must not be accepted) and `equivalent_forms`
(each is the same answer written differently)."""

from __future__ import annotations

import re
from fractions import Fraction

from sao_core.envs.exact import build, clean
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
            out.append((gold, ", ".join(items + ["99991"]), "added element"))
        if not prose and node.kind == "tuple":
            inner = _top_items(text[1:-1].strip()) or []
            if len(inner) > 1 and inner[0] != inner[1]:
                out.append((gold, "(" + ", ".join([inner[1], inner[0], *inner[2:]]) + ")", "permuted tuple"))
        for step in (1, 7):
            other = golds[(i + step) % len(golds)]
            if clean(other) != clean(gold):
                out.append((gold, bare(other), "another problem's answer"))
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
        if "\\cdot" in text:
            out.append((gold, text.replace("\\cdot", "\\times"), "\\times for \\cdot"))
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
    return out
