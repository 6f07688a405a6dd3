"""A small, fixed training corpus for the embedded tokenizer.

It is generated from a seeded RNG and a few hand-written sentences, so the tokenizer (and therefore
the embedded model) is byte-for-byte reproducible and needs no download. It covers what the tiny model
sees in this project: chat turns, tool calls, arithmetic, LaTeX answers, shell and Python snippets.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_SENTENCES = [
    "Compute the value and put the final answer in a box.",
    "The tool returned a result, so the answer follows from it.",
    "Let us check the edge cases before we submit the patch.",
    "Run the tests again and read the failing assertion carefully.",
    "A trajectory ends when the model stops or the episode times out.",
    "The critic estimates the value of the state before each action token.",
    "We use one rollout per prompt and learn from it as soon as it finishes.",
    "Find all integers n such that the expression is a perfect square.",
    "Prove that the sum of the first n odd numbers equals n squared.",
    "The function returns None when the input list is empty.",
    "Please fix the bug described in the issue and keep the public API.",
    "Therefore the answer is the smallest positive integer with this property.",
]

_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(sys.argv[1:])\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "git diff --stat\npython -m pytest tests/ -x -q\ncat setup.py | head -n 20\n",
    "ls -la src/\ngrep -rn \"def parse\" src/\nsed -n 10,40p src/module.py\n",
]

_LATEX = [
    "\\boxed{42}", "\\frac{1}{2}", "\\sqrt{2}", "x^2 + y^2 = z^2", "\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}",
    "\\left( a + b \\right)^2", "\\pi", "\\le", "\\ge", "\\cdot", "\\in \\mathbb{Z}", "\\binom{n}{k}",
]

_OPS = ["+", "-", "*"]


def _arithmetic_turn(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice(_OPS)
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return (
        f"<|im_start|>user\nCompute {a} {op} {b}<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>calc {a} {op} {b}</tool_call><|im_end|>\n"
        f"<|im_start|>tool\n<tool_response>{result}</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is \\boxed{{{result}}}.<|im_end|>\n"
    )


def corpus_lines(seed: int = 0, num_lines: int = 3000) -> Iterator[str]:
    """Yield `num_lines` deterministic text lines for tokenizer training."""
    rng = random.Random(seed)
    for i in range(num_lines):
        pick = i % 5
        if pick == 0:
            yield _arithmetic_turn(rng)
        elif pick == 1:
            yield " ".join(rng.sample(_SENTENCES, 3))
        elif pick == 2:
            yield rng.choice(_CODE)
        elif pick == 3:
            yield " ".join(rng.sample(_LATEX, 4)) + f" = {rng.randint(-500, 5000)}"
        else:
            numbers = " ".join(str(rng.randint(0, 10**rng.randint(1, 6))) for _ in range(8))
            yield f"{rng.choice(_SENTENCES)} {numbers}"
