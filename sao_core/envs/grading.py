"""Final-answer extraction and math equivalence grading.

`extract_boxed` pulls the last ``\\boxed{...}`` out of a model's answer (after any ``</think>`` block).
`MathGrader` decides whether two answers are mathematically equal with math-verify, in worker
processes: math-verify (sympy underneath) can run for ever on hostile input such as
``10^{10^{10}}`` (a C-level big-integer power that no signal interrupts), and its own timeouts use
``signal.alarm``, which works only in a main thread. Each worker runs one answer at a time in its
main thread under a fractional-second ``setitimer`` deadline (math-verify's own timeouts are turned
off); if the worker does not answer by the deadline plus a grace period, the parent kills it and a
fresh one is started on the next request. A timeout or a crash counts as wrong and is reported.

Workers use the ``spawn`` start method (no forked copy of a parent that may hold threads, CUDA or
torch state). As with any ``spawn`` pool, a script that grades at import time must keep its top-level
work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GRADE_REASONS = ("match", "mismatch", "no_answer", "unparseable", "unsettled", "timeout", "error")
#: Comparison modes: ``math_verify`` (training rewards: math-verify's equivalence) and ``exact``
#: (evaluation of IMO-AnswerBench: the exact-value rules of `sao_core.envs.exact`).
MODES = ("math_verify", "exact")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
#: an unescaped brace (a brace after a backslash, ``\\{`` or ``\\}``, is skipped with it, as `_balanced` does)
_BRACE = re.compile(r"\\[{}]|([{}])")
_THINK_END = "</think>"
_THINK_START = "<think>"


def answer_region(text: str) -> str | None:
    """The part of a model output that holds its answer: everything after the last ``</think>``.

    An opened but unclosed ``<think>`` block (reasoning cut off) has no answer region: None.
    """
    end = text.rfind(_THINK_END)
    if end >= 0:
        return text[end + len(_THINK_END):]
    if _THINK_START in text:
        return None
    return text


def _balanced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace that closes the one just before `start`, or None."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace (\{ or \}) does not nest
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_boxed(text: str | None) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (braces balanced) after any ``</think>``.

    Returns None when there is none (or the reasoning block is not closed). The content is stripped
    of surrounding whitespace; an empty box gives ``""``.
    """
    if not text:
        return None
    region = answer_region(text)
    if region is None:
        return None
    found = None
    for start, end in _closed_boxes(region):
        if found is None or start > found[0]:
            found = (start, end)
    return region[found[0]:found[1]].strip() if found is not None else None


def _closed_boxes(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every ``\\boxed{``/``\\fbox{`` in `text` whose brace is closed, in one
    pass (a stack of open braces), with `_balanced`'s rules: a brace right after a backslash does not nest.

    One pass, not one scan per box: `_balanced` from every box is quadratic in the text (8,000 unclosed
    ``\\boxed{`` took 30 s). The pairs are `_balanced`'s: whether a brace is escaped depends only on the
    character before it, and a box's brace closes at the first brace that brings the depth back."""
    opens = {match.end() for match in _BOXED.finditer(text)}   # content starts (just after the "{")
    if not opens:
        return []
    boxes = []
    stack: list[int] = []
    for match in _BRACE.finditer(text):
        brace = match.group(1)
        if brace is None:        # an escaped brace
            continue
        if brace == "{":
            stack.append(match.end())
        elif stack:
            start = stack.pop()
            if start in opens:
                boxes.append((start, match.start()))
    return boxes


@dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one answer. `reason` is one of GRADE_REASONS; `detail` says more."""

    correct: bool
    reason: str
    detail: str = ""
    seconds: float = 0.0
    rule: str = ""          # mode "exact": the rule that decided (see sao_core.envs.exact)


_WS = re.compile(r"\s+")


def _plain(text: str) -> str:
    """A cheap normal form for the exact-match fast path: no whitespace, no surrounding ``$``."""
    return _WS.sub("", text).strip("$")


# --------------------------------------------------------------------------- worker side


class _Deadline(BaseException):
    """Raised by the worker's timer. A BaseException so math-verify's `except Exception` misses it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Deadline()


def _grade_here(answer: str, gold: str, timeout_s: float, mode: str = "math_verify",
                text_shortcut: bool = True) -> tuple[str, str, str]:
    """Grade in this process's main thread with a fractional-second deadline: (reason, detail, rule)."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 1e-6))
    try:
        if mode == "exact":
            from sao_core.envs.exact import compare

            outcome = compare(answer, gold, text_shortcut=text_shortcut)
            return outcome.grade, outcome.detail, outcome.rule
        return (*_math_verify(answer, gold), "math_verify")
    except _Deadline:
        return "timeout", f"{'the exact rules' if mode == 'exact' else 'math-verify'} took longer than {timeout_s:g} s", ""
    except Exception as exc:  # any failure of the grader counts as wrong, and is reported
        return "error", f"{type(exc).__name__}: {exc}"[:500], ""
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _math_verify(answer: str, gold: str) -> tuple[str, str]:
    from math_verify import parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    if not gold_parsed:
        return "unparseable", "reference answer could not be parsed"
    answer_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not answer_parsed:
        return "unparseable", "answer could not be parsed"
    same = verify(gold_parsed, answer_parsed, timeout_seconds=None)
    return ("match", "math-verify") if same else ("mismatch", "")


def _worker_main(conn: Any) -> None:
    """Worker loop: import math-verify, say ready, then grade (answer, gold, timeout) requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes us
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings
    try:
        import math_verify  # noqa: F401  (warm the import before reporting ready)

        import sao_core.envs.exact  # noqa: F401
    except Exception as exc:
        conn.send(("failed", f"cannot import math_verify: {exc}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        answer, gold, timeout_s, mode, text_shortcut = request
        try:
            outcome = _grade_here(answer, gold, timeout_s, mode, text_shortcut)
        except _Deadline:  # the timer fired between the grading and its cancellation
            outcome = ("timeout", f"grading took longer than {timeout_s:g} s", "")
        conn.send(outcome)


# --------------------------------------------------------------------------- parent side


class _Worker:
    def __init__(self, ctx: Any):
        parent_conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True, name="sao-math-grader")
        self.process.start()
        child_conn.close()
        self.conn = parent_conn
        self.ready = False

    def wait_ready(self, timeout_s: float) -> str | None:
        """None when the worker is ready, else why not."""
        if self.ready:
            return None
        try:
            if not self.conn.poll(timeout_s):
                return f"grader worker did not start within {timeout_s:g} s"
            status, detail = self.conn.recv()
        except (EOFError, OSError) as exc:
            return f"grader worker died while starting ({type(exc).__name__})"
        if status != "ready":
            return detail
        self.ready = True
        return None

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1.0)
            if self.process.is_alive():
                self.process.kill()
        self.process.join(1.0)

    def stop(self) -> None:
        """Ask politely, then kill."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(0.5)
        self.kill()


class MathGrader:
    """Thread-safe math answer grader backed by a lazily started pool of `spawn` worker processes.

    `grade(answer, gold)` returns a GradeResult. Identical answers (up to whitespace and ``$``) match
    without a worker. Otherwise math-verify parses both (each wrapped in ``\\boxed{}``) and checks
    equivalence in a worker under `timeout_s` (per answer); a worker that has not answered after
    `timeout_s + kill_grace_s` is killed and replaced. Up to `max_workers` answers grade at once;
    more callers wait for a free worker. `close()` stops the workers; a closed grader refuses work.
    """

    def __init__(
        self,
        max_workers: int = 2,
        timeout_s: float = 10.0,
        kill_grace_s: float = 1.0,
        startup_timeout_s: float = 120.0,
    ):
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._live = 0
        self._closed = False
        self.stats = {"graded": 0, "timeouts": 0, "errors": 0, "workers_started": 0, "workers_killed": 0}

    # -- pool ---------------------------------------------------------------------------------------

    def _count(self, key: str) -> None:
        with self._cond:
            self.stats[key] += 1

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("MathGrader is closed")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_workers:
                    self._live += 1
                    self.stats["workers_started"] += 1  # (under the lock already)
                    break
                self._cond.wait()
        try:
            return _Worker(self._ctx)  # started outside the lock: spawning takes a while
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._cond:
            keep = healthy and not self._closed
            if keep:
                self._idle.append(worker)
            else:
                self._live -= 1
            self._cond.notify()
        if not keep:
            if not healthy:
                self._count("workers_killed")
            worker.kill()

    # -- grading ------------------------------------------------------------------------------------

    def grade(self, answer: str | None, gold: str, timeout_s: float | None = None, *,
              text_shortcut: bool = True, mode: str = "math_verify") -> GradeResult:
        """Is `answer` (an extracted final answer, e.g. a box's content) equal to `gold`?

        `text_shortcut=False` skips the identical-text fast path, so math-verify (or the exact rules)
        decides every answer. `mode` is one of :data:`MODES`: ``math_verify`` (the default, training
        rewards) or ``exact`` (`sao_core.envs.exact`: reason ``unsettled`` when it cannot tell exactly)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        started = time.monotonic()
        if answer is None or not answer.strip():
            return GradeResult(False, "no_answer", "no final answer")
        if text_shortcut and mode == "math_verify" and _plain(answer) == _plain(gold):
            return GradeResult(True, "match", "identical text", time.monotonic() - started)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        worker = self._acquire()
        healthy = False
        try:
            problem = worker.wait_ready(self.startup_timeout_s)
            if problem is not None:
                self._count("errors")
                return GradeResult(False, "error", problem, time.monotonic() - started)
            sent = time.monotonic()
            try:
                worker.conn.send((answer, gold, float(timeout), mode, text_shortcut))
                if not worker.conn.poll(timeout + self.kill_grace_s):
                    self._count("timeouts")
                    return GradeResult(False, "timeout", f"grader worker killed after {timeout:g} s",
                                       time.monotonic() - sent)
                reason, detail, rule = worker.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                self._count("errors")
                return GradeResult(False, "error", f"grader worker died ({type(exc).__name__})",
                                   time.monotonic() - sent)
            healthy = True
            self._count("graded")
            if reason == "timeout":
                self._count("timeouts")
            elif reason == "error":
                self._count("errors")
            return GradeResult(reason == "match", reason, detail, time.monotonic() - sent, rule)
        finally:
            self._release(worker, healthy)

    def grade_text(self, text: str | None, gold: str, timeout_s: float | None = None) -> GradeResult:
        """Grade a whole model output: its last ``\\boxed{}`` (see `extract_boxed`) against `gold`."""
        return self.grade(extract_boxed(text), gold, timeout_s)

    def close(self) -> None:
        """Stop all workers. Idempotent; callers still grading get their worker killed on return."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()

    def worker_pids(self) -> list[int]:
        """Process ids of the idle workers (for monitoring and tests)."""
        with self._cond:
            return [w.process.pid for w in self._idle if w.process.pid is not None]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_default_lock = threading.Lock()
_default: MathGrader | None = None


def default_grader() -> MathGrader:
    """The process-wide shared grader (created on first use, closed at exit), used by the envs."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = MathGrader()
        return _default


def close_default_grader() -> None:
    global _default
    with _default_lock:
        grader, _default = _default, None
    if grader is not None:
        grader.close()


atexit.register(close_default_grader)
