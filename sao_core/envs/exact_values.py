"""The parser and the value rules of the exact answer comparison (`sao_core.envs.exact`, which documents the
semantics and holds `compare`): tokens and the expression parser, answer structure (`build` → `Node`), and the
rules on values (`expressions`, `nodes`: numbers, expressions, sets, tuples, intervals, unions, relations)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MATCH, MISMATCH, UNSETTLED = "match", "mismatch", "unsettled"


@dataclass(frozen=True)
class Outcome:
    grade: str            # match | mismatch | unsettled
    rule: str             # which rule decided: text | value | symbolic | structure | unparsed | ...
    detail: str = ""
    final: bool = False   # a structural rule's verdict that no other reading may override


class ParseError(ValueError):
    pass


# ------------------------------------------------------------------------------------------ text clean

_TEXT = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mbox|operatorname|mathbf|boxed)\s*\{([^{}]*)\}")
# \! before a letter is a space too; a named command is one only when no letter follows it
_SPACES = re.compile(r"\\[;:!]|~|\\(?:quad|qquad|displaystyle|textstyle|scriptstyle|left|right|bigl|bigr|Bigl|Bigr"
                     r"|big|Big)(?![A-Za-z])")
#: LaTeX control space ``\ `` (a backslash before whitespace that is not the second half of a ``\\`` line break)
_CONTROL_SPACE = re.compile(r"(?<!\\)\\(?=\s)")
#: commands renamed to one spelling; whole command names only (``\cdots`` is not ``\cdot`` + ``s``)
_RENAME_CMD = {"dfrac": "\\frac", "tfrac": "\\frac", "leqslant": "\\leq", "geqslant": "\\geq", "neq": "\\ne",
               "lvert": "|", "rvert": "|", "vert": "|", "mid": "\\MID", "cdot": "*", "times": "*", "ast": "*",
               "lbrace": "\\{", "rbrace": "\\}", "dots": "\\ldots", "cdots": "\\ldots", "dotsc": "\\ldots",
               "dotsb": "\\ldots", "dotso": "\\ldots", "infin": "\\infty"}
_RENAME_CMD_RE = re.compile(r"\\(" + "|".join(sorted(_RENAME_CMD, key=len, reverse=True)) + r")(?![A-Za-z])")
_RENAME = [("≤", "\\leq"), ("≥", "\\geq"), ("≠", "\\ne"), ("−", "-"), ("…", "\\ldots"), ("...", "\\ldots")]
_SEP_BRACE = re.compile(r"(?<=\d)\{,\}(?=\d{3}(?!\d))")
_SEP_THIN = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")
_SEP_SPACE = re.compile(r"(?<![\d.])\d{1,3}(?: \d{3})+(?![\d.])")
_SEP_COMMA = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d.,])")
_CONNECTIVE = re.compile(r"\s+(?:and|or)\s+|\s*;\s*")
#: math-style switches, which change only the size of what follows
_STYLE = re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|scriptscriptstyle)(?![A-Za-z])")
#: a trailing ``only`` (``3 \text{ only}``, ``x = 2 only``): it restates that the list is complete
_ONLY = re.compile(r"(?:\s*\\text\s*\{\s*only\s*\.?\s*\}|(?<![A-Za-z\\])\s*only)\s*\.?\s*$")
#: degree words after a value (``72 degrees``, ``72\text{ degrees}`` once unwrapped): the degree sign
_DEGREE_WORD = re.compile(r"(?<=[\d})])\s*(?:degrees|degree|deg)(?![A-Za-z])")
#: a bare percent sign (``96%``), spelled as LaTeX's ``\%``
_PERCENT = re.compile(r"(?<!\\)%")


def _outer_braces(text: str) -> str | None:
    """The inside of ``{...}`` when one unescaped brace pair encloses the whole text, else None."""
    if not (text.startswith("{") and text.endswith("}")):
        return None
    depth = 0
    for k, ch in enumerate(text):
        if ch in "{}" and k > 0 and text[k - 1] == "\\":
            continue                              # \{ and \} are set braces, not groups
        depth += 1 if ch == "{" else -1 if ch == "}" else 0
        if depth == 0 and k != len(text) - 1:
            return None
    return text[1:-1]


def surface(text: str) -> str:
    """The surface normaliser shared by every benchmark (the exact rules through `clean`, BeyondAIME's
    integers through `sao_core.eval.graders.parse_integer`): math-style switches (``\\displaystyle``,
    ``\\textstyle``) removed, a trailing ``only`` / ``\\text{ only}`` removed, and group braces around the
    whole answer (``{{123}}``) removed. It changes no value: a style switch and a group only change the
    typesetting, and ``3 only`` is the answer 3."""
    out = _STYLE.sub(" ", text).strip()
    for _ in range(8):
        before = out
        stripped = _ONLY.sub("", out).strip()
        out = stripped or out                     # "only" alone stays a word
        inner = _outer_braces(out)
        if inner is not None:
            out = inner.strip()
        if out == before:
            break
    return out


def clean(text: str) -> str:
    """A normal form of an answer's text: `surface` forms, math delimiters, text wrappers, spacing commands
    (``\\,``, ``\\;``, ``\\!``, ``\\:``, ``~``, the control space ``\\ ``, ``\\quad``) and a final full stop
    removed; ``\\le``/``\\ge`` spelled ``\\leq``/``\\geq``; ``\\cdot`` as ``*``; ``\\dots``/``\\cdots``/``…``
    as ``\\ldots``; degree words after a value as ``^\\circ`` (the ``degrees`` rule reads them); ``%`` as
    ``\\%`` (the ``percent`` rule); ``{,}``, ``\\,`` and spaces between groups of three digits removed;
    whitespace collapsed."""
    out = text.strip()
    for _ in range(3):
        out = _TEXT.sub(r"\1", out)
    out = out.replace("$", "").replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    out = surface(out)
    out = _RENAME_CMD_RE.sub(lambda m: _RENAME_CMD[m.group(1)], out)
    for old, new in _RENAME:
        out = out.replace(old, new)
    out = re.sub(r"\\le(?![a-z])", r"\\leq", out)
    out = re.sub(r"\\ge(?![a-z])", r"\\geq", out)
    out = _SEP_BRACE.sub("", out)
    out = _SEP_THIN.sub("", out)
    out = _SPACES.sub(" ", out)
    out = out.replace("\\,", " ")
    out = _CONTROL_SPACE.sub(" ", out)
    out = _DEGREE_WORD.sub("^\\\\circ", out)
    out = _PERCENT.sub(r"\\%", out)
    out = _SEP_SPACE.sub(lambda m: m.group(0).replace(" ", ""), out)
    out = re.sub(r"\s+", " ", out).strip()
    while out.endswith(".") and not out.endswith("\\ldots"):
        out = out[:-1].rstrip()
    return out


def squeeze(text: str) -> str:
    """`clean` without whitespace (the text-equality key); a space between two digits is kept."""
    return re.sub(r"(?<!\d) | (?!\d)", "", clean(text))


# ------------------------------------------------------------------------------------------ tokens

_TOKEN = re.compile(r"""
    (?P<num>\d+(?:\.\d+)?|\.\d+)
  | (?P<cmd>\\[A-Za-z]+|\\[{}|])
  | (?P<letter>[A-Za-z])
  | (?P<op>!!|<=|>=|!=|[-+*/^_(){}\[\],=<>!|'])
  | (?P<space>\s+)
""", re.X)

_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota",
          "kappa", "lambda", "mu", "nu", "xi", "rho", "varrho", "sigma", "tau", "upsilon", "phi", "varphi", "chi",
          "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega"}
_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "ln", "log", "exp", "arcsin", "arccos", "arctan"}
_RELS = {"=": "=", "<": "<", ">": ">", "\\leq": "<=", "\\geq": ">=", "<=": "<=", ">=": ">=", "\\ne": "!=",
         "!=": "!=", "\\lt": "<", "\\gt": ">"}
_FLIP = {"=": "=", "<": ">", ">": "<", "<=": ">=", ">=": "<=", "!=": "!="}
_MAX_EXPONENT = 10_000


def tokenize(text: str) -> list[str]:
    """The tokens of `text`; two numbers separated by a space (``4 2``) are not read."""
    tokens, pos, last, spaced = [], 0, None, False
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ParseError(f"cannot read {text[pos:pos + 10]!r}")
        pos = m.end()
        if m.lastgroup == "space":
            spaced = True
            continue
        if m.lastgroup == "num" and last == "num" and spaced:
            raise ParseError("two numbers side by side")
        tokens.append(m.group(0))
        last, spaced = m.lastgroup, False
    return tokens


class _Parser:
    """Recursive descent over the tokens of one expression (no relations, no commas at top level)."""

    def __init__(self, tokens: list[str]):
        import sympy

        self.sp = sympy
        self.t = tokens
        self.i = 0

    def peek(self, k: int = 0) -> str | None:
        return self.t[self.i + k] if self.i + k < len(self.t) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ParseError(f"expected {want or 'more'}, found {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> Any:
        value = self.expr()
        if self.peek() is not None:
            raise ParseError(f"unexpected {self.peek()!r}")
        return value

    def expr(self) -> Any:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def _starts_primary(self, tok: str | None) -> bool:
        if tok is None:
            return False
        if tok in ("(", "{", "\\{") or tok[0].isdigit() or tok[0] == "." or tok.isalpha():
            return True
        return tok.startswith("\\") and tok[1:] in (_GREEK | _FUNCS | {"frac", "sqrt", "binom", "lfloor", "lceil",
                                                                      "pi", "infty", "bar", "overline", "hat",
                                                                      "tilde", "varphi"})

    def term(self) -> Any:
        value = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "/"):
                self.take()
                rhs = self.unary()
                value = value * rhs if tok == "*" else value / rhs
            elif self._starts_primary(tok) or (tok == "|" and self._abs_open_ok()):
                if tok == "\\frac" and self.i > 0 and self.t[self.i - 1][0].isdigit():
                    raise ParseError("a number before a fraction (a mixed number?) is ambiguous")
                value = value * self.power()
            else:
                return value

    def _abs_open_ok(self) -> bool:
        return False   # an implicit product with |x| is ambiguous with the closing bar: not read

    def unary(self) -> Any:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> Any:
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            exponent = self.exponent()
            return self._pow(base, exponent)
        return base

    def _pow(self, base: Any, exponent: Any) -> Any:
        sp = self.sp
        if exponent.is_Number and base.is_Number and abs(exponent) > _MAX_EXPONENT:
            return sp.Pow(base, exponent, evaluate=False)
        return sp.Pow(base, exponent)

    def exponent(self) -> Any:
        tok = self.peek()
        if tok == "{":
            return self.group()
        if tok is not None and tok[0].isdigit():       # x^23 is x^2 * 3 in LaTeX: one character
            self.take()
            if len(tok) > 1:
                self.t.insert(self.i, tok[1:])
            return self.sp.Integer(int(tok[0]))
        if tok == "-":
            self.take()
            return -self.exponent()
        return self.postfix()

    def group(self) -> Any:
        self.take("{")
        value = self.expr()
        self.take("}")
        return value

    def raw_group(self) -> str:
        """The tokens of a ``{...}`` group as text (for subscripts and names)."""
        self.take("{")
        depth, out = 1, []
        while True:
            tok = self.take()
            if tok == "{":
                depth += 1
            elif tok == "}":
                depth -= 1
                if depth == 0:
                    return "".join(out)
            out.append(tok)

    def postfix(self) -> Any:
        value = self.primary()
        while self.peek() in ("!", "!!", "'"):
            tok = self.take()
            if tok == "'":
                raise ParseError("primes are not read")
            value = self.sp.factorial(value) if tok == "!" else self.sp.factorial2(value)
        return value

    def subscript(self) -> str:
        if self.peek() != "_":
            return ""
        self.take()
        if self.peek() == "{":
            return "_" + self.raw_group()
        tok = self.take()
        if tok[0].isdigit():                      # a_12 is a_1 2
            if len(tok) > 1:
                self.t.insert(self.i, tok[1:])
            return "_" + tok[0]
        return "_" + tok

    def symbol(self, name: str) -> Any:
        return self.sp.Symbol(name)

    def primary(self) -> Any:
        sp = self.sp
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return sp.Rational(Fraction(tok))
        if tok.isalpha() and len(tok) == 1:
            sub = self.subscript()
            if tok == "e" and not sub:
                return sp.E
            return self.symbol(tok + sub)
        if tok == "(":
            value = self.expr()
            self.take(")")
            return value
        if tok == "{":
            value = self.expr()
            self.take("}")
            return value
        if tok == "|":
            value = self.expr()
            self.take("|")
            return sp.Abs(value)
        if tok.startswith("\\"):
            name = tok[1:]
            if name in _GREEK:
                return self.symbol(name + self.subscript())
            if name == "pi":
                return sp.pi
            if name == "infty":
                return sp.oo
            if name in ("bar", "overline", "hat", "tilde"):
                return self.symbol(f"{name}({self.raw_group()})" + self.subscript())
            if name == "frac":
                num = self._frac_arg()
                den = self._frac_arg()
                return num / den
            if name == "binom":
                return sp.binomial(self.group(), self.group())
            if name == "sqrt":
                if self.peek() == "[":
                    self.take("[")
                    index = self.expr()
                    self.take("]")
                    return sp.root(self._frac_arg(), index)
                return sp.sqrt(self._frac_arg())
            if name in ("lfloor", "lceil"):
                value = self.expr()
                self.take("\\rfloor" if name == "lfloor" else "\\rceil")
                return sp.floor(value) if name == "lfloor" else sp.ceiling(value)
            if name in _FUNCS:
                return self.function(name)
        raise ParseError(f"cannot read {tok!r}")

    def _frac_arg(self) -> Any:
        tok = self.peek()
        if tok == "{":
            return self.group()
        if tok is not None and tok[0].isdigit():      # \frac12
            self.take()
            if len(tok) > 1:
                self.t.insert(self.i, tok[1:])
            return self.sp.Integer(int(tok[0]))
        return self.primary()

    def function(self, name: str) -> Any:
        sp = self.sp
        base = None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.group() if self.peek() == "{" else self.primary()
        power = None
        if self.peek() == "^":
            self.take()
            power = self.exponent()
        if self.peek() == "(":
            self.take()
            arg = self.expr()
            self.take(")")
        else:
            arg = self.power()
        funcs = {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec, "csc": sp.csc,
                 "ln": sp.log, "log": sp.log, "exp": sp.exp, "arcsin": sp.asin, "arccos": sp.acos,
                 "arctan": sp.atan}
        value = sp.log(arg, base) if base is not None else funcs[name](arg)
        return self._pow(value, power) if power is not None else value


def parse_expression(text: str) -> Any:
    """A sympy expression of a LaTeX expression (raises ParseError)."""
    tokens = tokenize(text)
    if not tokens:
        raise ParseError("empty")
    return _Parser(tokens).parse()


# ------------------------------------------------------------------------------------------ structure

@dataclass
class Node:
    kind: str                       # expr | rel | label | set | tuple | list | seq | interval | union | opaque
    text: str                       # squeezed text
    value: Any = None               # expr: sympy; rel: (ops, [sympy]); label: (label text, Node); interval:
    items: list[Node] | None = None  # (left closed, right closed); set/tuple/list/seq/union: items


_OPEN = {"(": ")", "[": "]", "{": "}", "\\{": "\\}", "|": "|"}


def _split_top(tokens: list[str], seps: set[str]) -> list[list[str]]:
    """Split `tokens` at the top-level tokens in `seps` (outside any bracket)."""
    parts: list[list[str]] = [[]]
    stack: list[str] = []
    for tok in tokens:
        if tok in ("(", "[", "{", "\\{", "\\lfloor", "\\lceil"):
            stack.append(tok)
        elif tok in (")", "]", "}", "\\}", "\\rfloor", "\\rceil") and stack:
            stack.pop()
        if not stack and tok in seps:
            parts.append([])
        else:
            parts[-1].append(tok)
    return parts


_OPENING = ("(", "[", "{", "\\{")
_CLOSING = (")", "]", "}", "\\}")


def _depths(tokens: list[str]) -> Iterator[tuple[str, int]]:
    """Each of `tokens` with the bracket depth just after it: ``(``, ``[``, ``{`` and ``\\{`` open a level, their
    closing tokens close one (an unmatched closing goes below 0)."""
    depth = 0
    for tok in tokens:
        if tok in _OPENING:
            depth += 1
        elif tok in _CLOSING:
            depth -= 1
        yield tok, depth


def _wrapped(tokens: list[str], opening: str, closing: str) -> bool:
    """Do `tokens` start with `opening` whose matching bracket is the last token?"""
    if len(tokens) < 2 or tokens[0] != opening or tokens[-1] != closing:
        return False
    for k, (tok, depth) in enumerate(_depths(tokens)):
        if depth == 0 and tok in _CLOSING and k != len(tokens) - 1:
            return False
    return True


def _text(tokens: list[str]) -> str:
    return "".join(tokens)


def _after_name(tokens: list[str]) -> list[str] | None:
    """The tokens after a leading name (one Latin letter or a Greek command, with an optional subscript
    ``_1`` / ``_{ij}``), or None when `tokens` do not start with a name."""
    if not tokens:
        return None
    head = tokens[0]
    if not ((len(head) == 1 and head.isalpha()) or (head.startswith("\\") and head[1:] in _GREEK)):
        return None
    rest = tokens[1:]
    if rest[:1] == ["_"]:
        if len(rest) >= 2 and rest[1] != "{":
            rest = rest[2:]
        elif rest[1:2] == ["{"]:
            close = rest.index("}") if "}" in rest else -1
            if close < 0:
                return None
            rest = rest[close + 1:]
    return rest


def _is_label(tokens: list[str]) -> bool:
    """A label is a name: ``x``, ``a_{ij}``, ``\\lambda``, ``f(x)``, ``P(x,y)``, ``g(n)``."""
    rest = _after_name(tokens)
    if rest is None:
        return False
    if not rest:
        return True
    return rest[0] == "(" and rest[-1] == ")" and all(t.isalpha() or t == "," for t in rest[1:-1])


def applied_name(tokens: list[str]) -> str | None:
    """The name of a labelled quantity, or None: a function letter (Latin, or Greek such as ``\\tau``, with an
    optional subscript) applied to one bracketed argument: ``\\tau(-1)``, ``P(0)``, ``f_1(x)``. Used for the
    sides of relations (`relation_side`), where ``\\tau(-1) \\le 0`` says something about the value of
    τ at -1, not about the product τ·(-1). Not a labelled quantity when the letter is in its own argument
    (``x(x-1)`` is a product) or the argument is empty."""
    rest = _after_name(tokens)
    if not rest or len(rest) < 3 or not _wrapped(rest, "(", ")"):
        return None
    if tokens[0] in rest:
        return None
    return _text(tokens)


def relation_side(tokens: list[str]) -> Any:
    """One side of a relation as a sympy expression: a lone labelled quantity (`applied_name`) is one opaque
    symbol named by its text (``\\tau(-1)``), anything else is parsed as an expression (``2(x-1)`` stays a
    product). Raises ParseError like `parse_expression`."""
    name = applied_name(tokens)
    if name is not None:
        import sympy

        return sympy.Symbol(name)
    return parse_expression(" ".join(tokens))


def build(text: str, *, comma_thousands: bool = False) -> Node:
    """The structure of an answer (see the module docstring)."""
    cleaned = clean(text)
    if comma_thousands:
        cleaned = _SEP_COMMA.sub(lambda m: m.group(0).replace(",", ""), cleaned)
    cleaned = _CONNECTIVE.sub(",", cleaned)
    try:
        tokens = tokenize(cleaned)
    except ParseError:
        return Node("opaque", squeeze(text))
    return _node(tokens)


def _node(tokens: list[str]) -> Node:
    text = _text(tokens)
    if not tokens:
        return Node("opaque", "")
    unions = _split_top(tokens, {"\\cup"})
    if len(unions) > 1:
        return Node("union", text, items=[_node(_interval_hint(p)) for p in unions])
    parts = _split_top(tokens, {","})
    if len(parts) > 1:
        items = [_node(p) for p in parts]
        if any(i.kind == "opaque" and i.text == "\\ldots" for i in items):
            return Node("seq", text, items=items)
        return Node("list", text, items=items)
    if _wrapped(tokens, "\\{", "\\}"):
        inner = tokens[1:-1]
        items = [_node(p) for p in _split_top(inner, {","})] if inner else []
        if any(i.kind == "opaque" and i.text == "\\ldots" for i in items):
            return Node("seq", text, items=items)
        return Node("set", text, items=items)
    if tokens[0] in ("(", "[") and tokens[-1] in (")", "]") and (
            _wrapped(tokens, "(", ")") or _wrapped(tokens, "[", "]") or _interval_shape(tokens)):
        inner = _split_top(tokens[1:-1], {","})
        if len(inner) > 1:
            items = [_node(p) for p in inner]
            if tokens[0] == "[" or tokens[-1] == "]" or (len(items) == 2 and any("\\infty" in i.text for i in items)):
                if len(items) == 2:
                    return Node("interval", text, (tokens[0] == "[", tokens[-1] == "]"), items)
                return Node("opaque", text)
            return Node("tuple", text, items=items)
    if tokens == ["\\ldots"]:
        return Node("opaque", "\\ldots")
    # relations
    chain, ops = relation_chain(tokens)
    if ops:
        if ops == ["="] and _is_label(chain[0]):
            return Node("label", text, (_text(chain[0]), _node(chain[1])))
        try:
            sides = [relation_side(side) for side in chain]
        except (ParseError, TypeError, ValueError, ZeroDivisionError, RecursionError):
            return Node("opaque", text)
        return Node("rel", text, (ops, sides))
    try:
        return Node("expr", text, parse_expression(" ".join(tokens)))
    except (ParseError, TypeError, ValueError, ZeroDivisionError, RecursionError):
        return Node("opaque", text)
    except Exception:     # noqa: BLE001  sympy raises many kinds on odd input: not readable
        return Node("opaque", text)


def relation_chain(tokens: list[str]) -> tuple[list[list[str]], list[str]]:
    """`tokens` split at their top-level relation symbols (outside brackets): (the sides, the relations between
    them, normalised by `_RELS`); no relation gives one side and no relations."""
    chain: list[list[str]] = [[]]
    ops: list[str] = []
    for tok, depth in _depths(tokens):
        if depth == 0 and tok in _RELS:
            ops.append(_RELS[tok])
            chain.append([])
        else:
            chain[-1].append(tok)
    return chain, ops


def _interval_shape(tokens: list[str]) -> bool:
    """``(a, b]`` / ``[a, b)``: a bracket pair of different kinds around a top-level comma."""
    inner = tokens[1:-1]
    depth = 0
    for _, depth in _depths(inner):
        if depth < 0:
            return False
    return depth == 0 and "," in inner


def _interval_hint(tokens: list[str]) -> list[str]:
    return tokens


# ------------------------------------------------------------------------------------------ compare

_POINTS = ((2, 3, 5, 4, 6, 7), (3, 5, 2, 6, 4, 2), (5, 2, 4, 3, 7, 6), (4, 6, 3, 2, 5, 3))
_RATIONAL_POINTS = ((Fraction(7, 3), Fraction(5, 2), Fraction(11, 4), Fraction(13, 5), Fraction(17, 6)),)


def _names(expr: Any) -> set[str]:
    return {s.name for s in expr.free_symbols}


def _numeric(expr: Any, values: dict[Any, Any]) -> Any:
    """The value of `expr` at `values` to 60 digits, or None when it is not a finite number there."""
    try:
        value = expr.subs(values).evalf(60) if values else expr.evalf(60)
    except Exception:    # noqa: BLE001
        return None
    if not value.is_number or value.has(*_bad()):
        return None
    try:
        return complex(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _bad() -> tuple[Any, ...]:
    import sympy

    return (sympy.zoo, sympy.nan, sympy.oo, -sympy.oo)


def _huge(expr: Any) -> bool:
    import sympy

    return any(p.exp.is_Number and abs(p.exp) > _MAX_EXPONENT for p in expr.atoms(sympy.Pow))


def _differs(a: Any, b: Any, values: dict[Any, Any]) -> bool | None:
    """True when a and b differ at `values`, False when they agree to 30 digits, None when unknown."""
    try:
        return _differs_at(a, b, values)
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return None


def _differs_at(a: Any, b: Any, values: dict[Any, Any]) -> bool | None:
    import sympy

    try:
        exact = (a - b).subs(values) if values else a - b
    except Exception:    # noqa: BLE001
        exact = None
    if exact is not None and exact.is_Rational:          # integers, fractions: decided exactly
        return exact != 0
    try:
        da = a.subs(values).evalf(60) if values else a.evalf(60)
        db = b.subs(values).evalf(60) if values else b.evalf(60)
    except Exception:    # noqa: BLE001
        return None
    if not (da.is_number and db.is_number) or da.has(*_bad()) or db.has(*_bad()):
        if da == db and da in (sympy.oo, -sympy.oo):
            return False
        return None
    diff = abs(complex(sympy.N(da - db, 60)))
    scale = max(1.0, abs(complex(da)), abs(complex(db)))
    return diff > 1e-30 * scale


def expressions(a: Any, b: Any) -> Outcome:
    """Exact comparison of two sympy expressions (see the module docstring)."""
    import sympy

    if a == b:
        return Outcome(MATCH, "value", "the same value")
    if (a in (sympy.oo, -sympy.oo)) or (b in (sympy.oo, -sympy.oo)):
        return Outcome(MISMATCH, "value", "different values")
    same_names = _names(a) == _names(b)
    if _huge(a) or _huge(b):
        differs = _differs(a, b, {})
        if differs and not (a.free_symbols | b.free_symbols):
            return Outcome(MISMATCH, "value", "different values")
        return Outcome(UNSETTLED, "value", "a power too large to compare exactly")
    symbols = sorted(a.free_symbols | b.free_symbols, key=lambda s: s.name)
    try:
        if same_names and sympy.expand(a - b) == 0:
            return Outcome(MATCH, "value", "the same value (expanded)")
    except Exception:    # noqa: BLE001
        pass
    # probes at integer points: a difference there is a proof of a different value
    agreed = 0
    for point in _POINTS:
        values = {s: sympy.Integer(point[k % len(point)] + k // len(point)) for k, s in enumerate(symbols)}
        differs = _differs(a, b, values)
        if differs:
            return Outcome(MISMATCH, "value",
                           "different values" + (f" (at {values})" if values else ""))
        if differs is False:
            agreed += 1
        if not symbols:
            break
    if not same_names:
        return Outcome(UNSETTLED, "symbols", "the free symbols differ: "
                       f"{sorted(_names(a))} and {sorted(_names(b))}")
    if _combinatorial(a) or _combinatorial(b):
        proved = factorial_identity(a, b)
        if proved:
            return proved
    try:
        if sympy.simplify(a - b) == 0:
            return Outcome(MATCH, "symbolic", "sympy proves the difference is 0")
    except Exception:    # noqa: BLE001
        pass
    for point in _RATIONAL_POINTS:
        values = {s: sympy.Rational(point[k % len(point)]) for k, s in enumerate(symbols)}
        if symbols and _differs(a, b, values):
            return Outcome(UNSETTLED, "value", "equal at the integer test points, different elsewhere")
    return Outcome(UNSETTLED, "value", "equal at the test points" if agreed else "not comparable"
                   ", not proved equal")


def _combinatorial(expr: Any) -> bool:
    import sympy

    return bool(expr.atoms(sympy.factorial, sympy.factorial2, sympy.binomial, sympy.gamma))


def _factorial2_as_factorials(expr: Any) -> Any | None:
    """`expr` with every symbolic double factorial written with factorials, or None when the parity
    of an argument is not fixed: ``(2m-1)!! = (2m)!/(2^m m!)``, ``(2m)!! = 2^m m!`` (integer symbols)."""
    import sympy

    swaps = {}
    for atom in expr.atoms(sympy.factorial2):
        arg = sympy.expand(atom.args[0])
        if arg.is_number:
            continue
        try:
            poly = sympy.Poly(arg, *sorted(arg.free_symbols, key=lambda s: s.name))
        except sympy.PolificationFailed:
            return None
        coeffs = dict(poly.terms())
        constant = coeffs.pop((0,) * len(poly.gens), sympy.Integer(0))
        if not all(c.is_Integer and c % 2 == 0 for c in coeffs.values()) or not constant.is_Integer:
            return None
        half = (arg + 1) / 2 if constant % 2 else arg / 2
        swaps[atom] = (sympy.factorial(2 * half) / (2 ** half * sympy.factorial(half)) if constant % 2
                       else 2 ** half * sympy.factorial(half))
    return expr.xreplace(swaps) if swaps else expr


def factorial_identity(a: Any, b: Any) -> Outcome | None:
    """Rule ``factorial-identity``: sympy proves ``a - b = 0`` exactly after writing double factorials
    with factorials (`_factorial2_as_factorials`) and simplifying ratios of factorials, binomials and
    gamma functions (``combsimp``, ``gammasimp``); symbols are integers there. None when not proved
    (the other rules go on)."""
    import sympy

    ra, rb = _factorial2_as_factorials(a), _factorial2_as_factorials(b)
    if ra is None or rb is None:
        return None
    diff = ra - rb
    for simplify in (sympy.combsimp, sympy.gammasimp, lambda e: sympy.simplify(sympy.combsimp(e))):
        try:
            if simplify(diff) == 0:
                return Outcome(MATCH, "factorial-identity", "sympy proves the difference is 0 (factorials, "
                               "binomials, double factorials; integer symbols)")
        except Exception:    # noqa: BLE001
            continue
    return None


def _rounds_to(answer: Any, gold_text: str) -> bool:
    """Does the number `answer` round to the decimal `gold_text` at its number of decimals?"""
    import sympy

    decimals = len(gold_text.split(".")[1])
    try:
        value = sympy.Rational(answer) if answer.is_Rational else sympy.Rational(str(answer.evalf(40)))
    except (TypeError, ValueError):
        return False
    return abs(value - sympy.Rational(Fraction(gold_text))) <= sympy.Rational(1, 2 * 10 ** decimals)


_UNORDERED = ("list", "set")


def nodes(answer: Node, gold: Node, *, top: bool = True) -> Outcome:
    """Compare two structures (`top`: the whole answers, where a label on one side only may be skipped)."""
    if answer.text == gold.text:
        return Outcome(MATCH, "text", "the same text")
    if answer.kind == "label" or gold.kind == "label":
        return _labelled(answer, gold, top)
    if answer.kind == "opaque" or gold.kind == "opaque":
        return Outcome(UNSETTLED, "unparsed", "the rules cannot read "
                       + ("the answer" if answer.kind == "opaque" else "the reference") + " exactly")
    if answer.kind == "expr" and gold.kind == "expr":
        result = expressions(answer.value, gold.value)
        if result.grade == MISMATCH and re.fullmatch(r"-?\d*\.\d+", gold.text) and answer.value.is_number \
                and _rounds_to(answer.value, gold.text):
            return Outcome(UNSETTLED, "decimal", "the answer rounds to the decimal reference but is not equal to it")
        return result
    if answer.kind in _UNORDERED or gold.kind in _UNORDERED:
        return _unordered(answer, gold)
    return _same_shape(answer, gold)


def _labelled(answer: Node, gold: Node, top: bool) -> Outcome:
    """Compare when one side or both are labelled (``x = 3``, ``A: 5``)."""
    if answer.kind == "label" and gold.kind != "label":
        label, value = answer.value
        if gold.kind in _UNORDERED and all(i.kind == "label" for i in gold.items or []):
            return _as_sets([answer], gold.items or [])
        if top and gold.kind not in _UNORDERED:
            return nodes(value, gold, top=False)
        return Outcome(UNSETTLED, "structure", f"the answer names {label}, the reference does not")
    if gold.kind == "label" and answer.kind != "label":
        return nodes(answer, gold.value[1], top=False) if top else \
            Outcome(UNSETTLED, "structure", "the reference names its parts, the answer does not")
    (la, va), (lg, vg) = answer.value, gold.value
    if la != lg:
        return Outcome(UNSETTLED if top else MISMATCH, "structure", f"different labels: {la} and {lg}")
    return nodes(va, vg, top=False)


def _unordered(answer: Node, gold: Node) -> Outcome:
    """Compare as sets when either side is a list or a set (a single value counting as one element)."""
    comparable = _UNORDERED + ("expr", "label")
    if answer.kind not in comparable or gold.kind not in comparable:
        return Outcome(UNSETTLED, "structure", f"a {answer.kind} and a {gold.kind}")
    a_items = answer.items if answer.kind in _UNORDERED else [answer]
    g_items = gold.items if gold.kind in _UNORDERED else [gold]
    return _as_sets(a_items or [], g_items or [])


def _same_shape(answer: Node, gold: Node) -> Outcome:
    """Compare tuples, sequences, intervals, unions and relations (a tuple and a sequence compare in order)."""
    if answer.kind != gold.kind:
        if {answer.kind, gold.kind} == {"tuple", "seq"}:
            return _in_order(answer.items or [], gold.items or [])
        return Outcome(UNSETTLED, "structure", f"a {answer.kind} and a {gold.kind}")
    if answer.kind in ("tuple", "seq"):
        return _in_order(answer.items or [], gold.items or [], seq=answer.kind == "seq")
    if answer.kind == "interval":
        if answer.value != gold.value:
            return Outcome(MISMATCH, "structure", "different interval ends (open / closed)")
        return _in_order(answer.items or [], gold.items or [])
    if answer.kind == "union":
        return _as_sets(answer.items or [], gold.items or [])
    if answer.kind == "rel":
        return _relations(answer.value, gold.value)
    return Outcome(UNSETTLED, "structure", f"cannot compare {answer.kind}")


def _in_order(a: list[Node], g: list[Node], seq: bool = False) -> Outcome:
    if len(a) != len(g):
        if seq or any(n.text == "\\ldots" for n in a + g):
            return Outcome(UNSETTLED, "structure", "lists with an ellipsis written differently")
        return Outcome(MISMATCH, "structure", f"{len(a)} parts, the reference has {len(g)}")
    results = [nodes(x, y, top=False) for x, y in zip(a, g, strict=True)]
    for x, y, r in zip(a, g, results, strict=True):
        if r.grade == MISMATCH:
            return Outcome(MISMATCH, "structure", f"part {x.text} differs from {y.text}: {r.detail}")
    if all(r.grade == MATCH for r in results):
        return Outcome(MATCH, _rule_of(results), "every part is the same, in order")
    return Outcome(UNSETTLED, "structure", "; ".join(r.detail for r in results if r.grade == UNSETTLED))


def _as_sets(a: list[Node], g: list[Node]) -> Outcome:
    if any(n.text == "\\ldots" for n in a + g):
        return Outcome(UNSETTLED, "structure", "a set with an ellipsis")
    grid = [[nodes(x, y, top=False) for y in g] for x in a]
    rows = [[c.grade for c in row] for row in grid]
    for x, row in zip(a, rows, strict=True):
        if all(c == MISMATCH for c in row):
            return Outcome(MISMATCH, "structure", f"{x.text} is not in the reference")
    for j, y in enumerate(g):
        if all(rows[i][j] == MISMATCH for i in range(len(a))):
            return Outcome(MISMATCH, "structure", f"{y.text} is missing")
    if all(MATCH in row for row in rows) and all(any(rows[i][j] == MATCH for i in range(len(a))) for j in range(len(g))):
        return Outcome(MATCH, _rule_of([c for row in grid for c in row if c.grade == MATCH]),
                       "the same elements")
    return Outcome(UNSETTLED, "structure", "some elements cannot be compared exactly")


def _rule_of(results: list[Outcome]) -> str:
    rules = {r.rule for r in results}
    return "symbolic" if "symbolic" in rules else "value" if "value" in rules else "text"


def _relations(a: tuple[list[str], list[Any]], g: tuple[list[str], list[Any]]) -> Outcome:
    ops_a, sides_a = a
    ops_g, sides_g = g
    if ops_a == ["="] and ops_g == ["="]:
        da, dg = sides_a[0] - sides_a[1], sides_g[0] - sides_g[1]
        first = expressions(da, dg)
        if first.grade == MATCH:
            return first
        second = expressions(da, -dg)
        if second.grade == MATCH:
            return second
        return Outcome(UNSETTLED, "relation", "different equations (they may still have the same solutions)")
    candidates = [(ops_a, sides_a)]
    if len(ops_a) == len(ops_g):
        candidates.append(([_FLIP[o] for o in reversed(ops_a)], list(reversed(sides_a))))
    for ops, sides in candidates:
        if ops == ops_g:
            results = [expressions(x, y) for x, y in zip(sides, sides_g, strict=True)]
            if all(r.grade == MATCH for r in results):
                return Outcome(MATCH, _rule_of(results), "the same relation")
    return Outcome(UNSETTLED, "relation", "relations written differently")
