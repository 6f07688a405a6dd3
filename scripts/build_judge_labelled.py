"""Build sao_core/eval/judge_labelled.jsonl, the judge-agreement set: the hand-written structural pairs of
tests/data/eval/imo_equivalent_forms.json (equal) and imo_wrong_forms.json (different), and hand-written prose
pairs for IMO-AnswerBench v2 reference answers worded in prose (the answers the rules leave to the judge).

    .venv/bin/python scripts/build_judge_labelled.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "sao_core" / "eval" / "judge_labelled.jsonl"

# (reference, answer, equal, note): references are real IMO-AnswerBench v2 prose answers; answers ours.
PROSE = [
    ("odd $n$", "all odd integers $n$", True, "prose paraphrase"),
    ("odd $n$", "$n \\equiv 1 \\pmod 2$", True, "prose vs congruence"),
    ("odd $n$", "$n$ even", False, "parity swapped"),
    ("odd $n$", "all positive integers $n$", False, "all n for odd n"),
    ("even $n$", "$n = 2k$ for integer $k$", True, "prose vs progression"),
    ("even $n$", "$n$ divisible by 4", False, "a subset"),
    ("n is prime", "$n$ must be a prime number", True, "paraphrase"),
    ("n is prime", "$n$ is prime or $n = 1$", False, "an extra value"),
    ("m is prime or 1", "$m = 1$ or $m$ prime", True, "order of the cases"),
    ("m is prime or 1", "$m$ prime", False, "a missing value"),
    ("1 and odd prime numbers", "$n = 1$ or $n$ an odd prime", True, "paraphrase"),
    ("1 and odd prime numbers", "all primes and 1", False, "2 added"),
    ("All powers of 2", "$n = 2^k$, $k \\ge 0$", True, "prose vs formula"),
    ("All powers of 2", "$n = 2^k$, $k \\ge 1$", False, "1 missing"),
    ("All numbers of the form $4k+3$", "$n \\equiv 3 \\pmod 4$", True, "congruence"),
    ("All numbers of the form $4k+3$", "$n \\equiv 1 \\pmod 4$", False, "wrong residue"),
    ("All prime numbers, 1, 4, and 6.", "$1, 4, 6$ and every prime", True, "order"),
    ("All prime numbers, 1, 4, and 6.", "every prime and 1, 4", False, "6 missing"),
    ("all multiples of 14, excluding 0", "$14k$ for nonzero integers $k$", True, "paraphrase"),
    ("all multiples of 14, excluding 0", "all multiples of 7 except 0", False, "multiples of 7"),
    ("60, 100, 8p (for all odd primes p)", "$n \\in \\{60, 100\\} \\cup \\{8p : p \\text{ odd prime}\\}$", True,
     "set notation"),
    ("60, 100, 8p (for all odd primes p)", "60, 100 and $8p$ for all primes $p$", False, "p = 2 added"),
    ("All positive integers", "every $n \\in \\mathbb{Z}_{>0}$", True, "symbol"),
    ("All positive integers", "all nonnegative integers", False, "0 added"),
    ("no solutions", "there is no such $n$", True, "paraphrase"),
    ("no solutions", "$n = 1$ only", False, "a solution claimed"),
    ("No positive integers", "none", True, "paraphrase"),
    ("1 if triangle is isoceles, otherwise 2", "2 in general, 1 when the triangle is isosceles", True,
     "cases in another order"),
    ("1 if triangle is isoceles, otherwise 2", "always 2", False, "a case missing"),
    ("$P(n)=(n+2a)^{2}-2a^{2}$ for some nonnegative integer $a$", "$P(n) = n^2 + 4an + 2a^2$, $a \\ge 0$ an integer",
     True, "expanded"),
    ("$P(n)=(n+2a)^{2}-2a^{2}$ for some nonnegative integer $a$", "$P(n) = n^2$", False, "one member only"),
    ("$f(x,y)= g(x+y, xy(x-y)^{2})$ for some polynomial $g$", "$f = g(x+y, xy(x-y)^2)$, $g$ any polynomial", True,
     "paraphrase"),
]


def main() -> int:
    rows = []
    equal = json.loads((ROOT / "tests/data/eval/imo_equivalent_forms.json").read_text())["forms"]
    wrong = json.loads((ROOT / "tests/data/eval/imo_wrong_forms.json").read_text())["wrong"]
    for form in equal:
        rows.append({"reference": form["gold"], "answer": form["answer"], "equal": True,
                     "note": f"{form['category']}: {form.get('note', '')}".strip(": ")})
    for form in wrong:
        rows.append({"reference": form["gold"], "answer": form["answer"], "equal": False,
                     "note": f"{form['category']}: {form.get('why', '')}".strip(": ")})
    for reference, answer, same, note in PROSE:
        rows.append({"reference": reference, "answer": answer, "equal": same, "note": f"prose: {note}"})
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{OUT}: {len(rows)} pairs ({sum(r['equal'] for r in rows)} equal)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
