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
  position, ellipsis included (``\\{1,2,\\cdots,1235\\}`` = ``1,2,\\ldots,1235``). Multi-part answers
  (``a=s+t, b=…``) are compared part by part, all parts
  (as a set of ``label = value`` parts; a label must be the same text). ``x = v`` is the value ``v``
  when the reference has no label, and a reference ``f(x)=v`` with one part accepts the bare ``v``.
- **Function values are quantities, not products.** A function letter (Latin, or Greek such as ``\\tau``,
  optionally subscripted) applied to an argument, standing alone as a side of a relation or in the variable
  slot of ``… \\in S``, is one labelled quantity named by its text: ``\\tau(-1) \\le 0`` = ``(-\\infty, 0]``,
  ``-6 \\le P(-1) \\le 5`` = ``P(0) \\in [-6,5]`` = ``[-6,5]``, ``\\tau(-1) \\geq 0`` is different from
  ``(-\\infty, 0]`` (1). Products stay products: ``2(x-1)``, ``a(b+c)`` in an expression, a side that is more
  than the lone application, and ``x(x-1)`` (the letter in its own argument).
- **Surface forms** are normalised once, in the parser (`sao_core.envs.exact_values.surface` and `clean`,
  shared with BeyondAIME's integers): spacing (``\\,``, ``\\;``, ``\\!``, ``\\:``, ``~``, the control space
  ``\\ ``), ``\\displaystyle``/``\\textstyle``, group braces around the whole answer (``{{123}}``), a trailing
  ``only`` (``3 \\text{ only}`` is 3), ``\\dots``/``\\cdots``/``\\dotsc``/``…`` as ``\\ldots``, degree words
  after a value (``72 \\text{ degrees}`` is ``72^\\circ``: the ``degrees`` rule), ``%`` as ``\\%`` (the
  ``percent`` rule).
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
    ``named-tuple``: names are matched against names (``(a,b,p)=(2,5,3)`` = ``(p,a,b)=(3,2,5)``, also
    assignments ``p=3, a=2, b=5``). Against an unnamed tuple the names are placed in the order the problem
    declares (`compare`'s ``problem``: the first tuple of letters in it with the same names, ``Find all
    triples $(n, x, y)$``): ``(x,n,y)=(2,\\frac12,\\frac94)`` for ``(2,\\frac12,\\frac94)`` is a mismatch
    there, ``(a,b,p)=(2,5,3)`` for ``(3,2,5)`` asked as ``(p,a,b)`` a match. Without a declared order the
    answer's own order proves nothing: equal only when every order of the names is (``(x,y)=(0,0)``),
    different when every order is, else unsettled.
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
    (``\\pi - 2\\alpha`` for ``180 - 2\\alpha``) are unsettled. Degree words are degree signs (``72
    \\text{ degrees}`` = ``72``).
  - ``percent`` (checked with ``degrees``): ``96\\%`` = ``96`` (the reference's number is the percentage) and
    ``96\\%`` = ``96 \\%``; against the same value as a fraction (``0.96``, ``\\frac{24}{25}``) unsettled (the
    problem decides); different when it is neither (``95\\%`` for ``0.96``).
  - ``factorial-identity`` (in `expressions`): ``(2k-1)!! = \\frac{(2k)!}{2^k k!}``, ``\\binom{2k}{k} =
    \\frac{(2k)!}{(k!)^2}`` proved by sympy's ``combsimp``/``gammasimp`` after double factorials are
    written with factorials (symbols are integers there).

  - **Domains** (with ``problem``): a variable's declared domain (``positive integers $n$``, ``$p$ is a
    prime``, ``n \\in \\mathbb{Z}^+``, ``natural numbers``, ``real numbers``, lower bounds ``n \\geq 2``)
    limits ``relation-interval``, ``prose-set`` and ``congruence-progression``: a witness must be a member
    (0 proves nothing over the positive integers; a prime over the primes; any real over the reals), and
    sets that agree on every member are equal when what differs outside the domain is only left implicit
    (``n \\ne 2`` = ``n = 1, n \\geq 3`` over the positive integers, a mismatch by 0 over the integers);
    a listed value or bounded range outside the domain (``-1 < c < 1`` for positive c) is unsettled.

  A structural verdict and the structure rules' verdict must agree (else unsettled), except that a
  class reading overrides a value mismatch caused by renamed dummy parameters.
- Anything else the parser does not understand (``p_1 \\cdots p_k`` products with an ellipsis, words) is
  accepted only as the same
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
    Outcome,
    build,
    clean,
    expressions,
    nodes,
    parse_expression,
    squeeze,
    tokenize,
)

__all__ = ["MATCH", "MISMATCH", "UNSETTLED", "Outcome", "build", "clean", "compare",
           "expressions", "int_set", "nodes", "parse_expression", "real_set", "squeeze", "structural", "tokenize"]


def compare(answer: str, gold: str, text_shortcut: bool = True, *, problem: str | None = None) -> Outcome:
    """Is `answer` exactly the reference `gold`? (see the module docstring) `problem`, the problem statement
    when known, gives named tuples their declared order and variables their declared domain."""
    if text_shortcut and squeeze(answer) == squeeze(gold):
        return Outcome(MATCH, "text", "the same text")

    def again(a: str, g: str) -> Outcome:      # the whole comparison of rewritten texts, same problem
        return compare(a, g, problem=problem)

    found = structural(answer, gold, again, problem=problem)
    if found is not None and found.final:
        return found
    if _wordy(answer) or _wordy(gold):
        return found or Outcome(UNSETTLED, "prose", "words the rules cannot read exactly")
    gold_node = build(gold)
    single = gold_node.kind not in ("list", "set", "seq", "tuple", "union", "interval")
    answer_node = build(answer, comma_thousands=single)
    return _combine(found, nodes(answer_node, gold_node))
