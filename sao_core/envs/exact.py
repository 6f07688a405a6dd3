"""Exact answer comparison for IMO-AnswerBench: an answer is accepted only when it is the same
mathematical value as the reference.

`compare(answer, gold)` returns an :class:`Outcome`: ``match``, ``mismatch`` (proved different) or
``unsettled`` (the rules cannot tell exactly; the LLM judge decides, or it counts as wrong and is
listed). The semantics:

- **Numbers are exact.** Integers, fractions and finite decimals are exact rationals (``0.5`` is
  ``1/2``); there is no numeric tolerance. When the reference is a decimal, an answer that equals it
  exactly (``\\frac{7}{4}`` for ``1.75``) is accepted; one that only rounds to it at the reference's
  precision (``1.749`` for ``1.75``) is unsettled, never accepted; anything else is a mismatch.
- **Symbols keep their case** (``R`` is not ``r``), every letter is its own symbol (``dp`` is
  ``d·p``), ``7^{dp}`` is ``7^(d·p)`` and ``7^d p`` is ``7^d·p``; ``(2k-1)!!`` is the double factorial
  and ``((2k-1)!)!`` the factorial of a factorial; no unit is ever removed (``m`` is a symbol).
- **Expressions** are equal when sympy proves the difference is 0 (after expanding, else after
  ``simplify``) and both have the same free symbols (case-sensitive): ``-2(m-1)`` = ``2-2m``,
  ``p\\cdot 7^d`` = ``7^d p``. They are different (``mismatch``) when the difference is non-zero at an
  integer point (all symbols set to small integers) evaluated to 60 digits. Anything else (equal at the
  test points but not proved, different only at non-integer points, free symbols that differ) is
  unsettled.
- **Structure is kept.** ``\\{…\\}`` sets and bare comma lists (``2026, 2030``) are compared as sets
  (order and repeats do not matter); tuples ``(…)`` element by element in order; intervals with their
  bracket types; unions piece by piece; lists with an ellipsis (``1,2,\\ldots,1235``) position by
  position, ellipsis included. Multi-part answers (``a=s+t, b=…``) are compared part by part, all parts
  (as a set of ``label = value`` parts; a label must be the same text). ``x = v`` is the value ``v``
  when the reference has no label, and a reference ``f(x)=v`` with one part accepts the bare ``v``.
- **Relations** (``0<c<1``, ``x\\geq -\\frac{6}{5}``) match when the operators are the same (or the
  chain is written the other way round) and every side is equal; any other difference is unsettled
  (``n>1`` and ``n\\geq 2`` may be the same set of integers). An equation that is not a labelled
  value (``3a^2-b^2=3``) matches when ``lhs-rhs`` is the same up to sign, else it is unsettled.
- **Structural rules** (`structural`; each named in ``Outcome.rule``, each settles equal only on an exact
  proof and different only on an exact witness, else unsettled):

  - ``relation-interval``: relations in one variable, intervals, unions, ``\\mathbb{R}``, ``\\setminus``,
    ``x \\in …``, ``\\{x : …\\}`` as sets of reals (sympy ``solveset``): ``x \\le 0`` = ``(-\\infty, 0]``,
    ``x \\ne -3`` = ``(-\\infty,-3)\\cup(-3,\\infty)``. ``or`` is a union, ``and`` an intersection, a comma
    list of inequalities is settled only when both readings agree. Different when an integer is in one set
    only; sets that differ only at non-integers (``x > 1``, ``x \\geq 2``) are unsettled.
  - ``plus-minus``: an item with one ``\\pm``/``\\mp`` is two items (``0, \\pm\\frac23``); two in one item
    are not read. ``solution-list``: ``x=5, x=-3``, ``x = 5 or x = -3``, ``x \\in \\{5,-3\\}`` are ``5, -3``.
    ``named-tuple``: ``(p,a,b)=(3,2,5)`` is ``(3,2,5)`` (names assumed in the problem's order); names
    are matched against names; assignments ``p=3, a=2, b=5`` against an unnamed tuple are unsettled
    unless no order fits.
  - ``congruence-progression``: ``n \\equiv 3 \\pmod 4`` = ``n = 4k+3`` = ``n = 4m-1`` (residue classes;
    the parameter is a dummy over the integers, a range like ``k \\geq 1`` is kept); ``n = 4k-1`` against
    ``n = 4k+3`` (same parameter: k may be given) and a bare reference ``2k+1`` (a value?) are unsettled.
  - ``prose-set``: English sets (all positive integers, odd n, powers of 2, multiples of 14, primes, no
    solutions, ``excluding 0``) and symbols (``\\mathbb{Z}``, ``\\mathbb{Z}^+``, ``\\mathbb{N}_0``,
    ``2\\mathbb{Z}+1``, ``\\emptyset``) as canonical sets of integers; a different declared domain
    (``\\mathbb{Z}`` vs positive integers, ``\\mathbb{N}``: is 0 in it?) is unsettled, and prose against
    prose is left to the judge.
  - ``degrees``: ``180^\\circ - 2\\alpha`` = ``180 - 2\\alpha`` (the signs dropped when the reference has no
    ``\\pi``); ``60^\\circ`` = ``\\frac{\\pi}{3}`` for numbers only; with symbols degrees against radians
    (``\\pi - 2\\alpha`` for ``180 - 2\\alpha``) are unsettled.
  - ``factorial-identity`` (in `expressions`): ``(2k-1)!! = \\frac{(2k)!}{2^k k!}``, ``\\binom{2k}{k} =
    \\frac{(2k)!}{(k!)^2}`` proved by sympy's ``combsimp``/``gammasimp`` after double factorials are
    written with factorials (symbols are integers there).

  A structural verdict and the structure rules' verdict must agree (else unsettled), except that a
  class reading overrides a value mismatch caused by renamed dummy parameters.
- Anything else the parser does not understand (``\\cdots`` products, words) is accepted only as the same
  normalised text, else unsettled.
- Thousands separators: ``1{,}234``, ``1\\,234`` and ``1 234`` (groups of three digits) are one number;
  ``1,234`` is one number only when the reference is a single item (otherwise the comma separates
  items).

Runs in the math grader's worker processes (`sao_core.envs.grading`, mode ``exact``) under their
timeouts; the probes and proofs are bounded (small integer points, no exponent above 10,000 evaluated).
"""

from __future__ import annotations

from sao_core.envs.exact_forms import _combine, _wordy, int_set, real_set, structural
from sao_core.envs.exact_values import (
    MATCH,
    MISMATCH,
    UNSETTLED,
    Node,
    Outcome,
    ParseError,
    build,
    clean,
    expressions,
    nodes,
    parse_expression,
    squeeze,
    tokenize,
)

__all__ = ["MATCH", "MISMATCH", "UNSETTLED", "Node", "Outcome", "ParseError", "build", "clean", "compare",
           "expressions", "int_set", "nodes", "parse_expression", "real_set", "squeeze", "structural", "tokenize"]


def compare(answer: str, gold: str, text_shortcut: bool = True) -> Outcome:
    """Is `answer` exactly the reference `gold`? (see the module docstring)"""
    if text_shortcut and squeeze(answer) == squeeze(gold):
        return Outcome(MATCH, "text", "the same text")
    found = structural(answer, gold, compare)
    if found is not None and found.final:
        return found
    if _wordy(answer) or _wordy(gold):
        return found or Outcome(UNSETTLED, "prose", "words the rules cannot read exactly")
    gold_node = build(gold)
    single = gold_node.kind not in ("list", "set", "seq", "tuple", "union", "interval")
    answer_node = build(answer, comma_thousands=single)
    return _combine(found, nodes(answer_node, gold_node))
