"""Final-answer extraction and math equivalence grading.

`extract_boxed` pulls the last ``\\boxed{...}`` out of a model's answer (after any ``</think>`` block).
`MathGrader` decides whether two answers are mathematically equal with math-verify, in worker
processes: math-verify (sympy underneath) can run for ever on hostile input such as
``10^{10^{10}}`` (a C-level big-integer power that no signal interrupts), and its own timeouts use
``signal.alarm``, which works only in a main thread. Each worker runs one answer at a time in its
main thread under a fractional-second ``setitimer`` deadline (math-verify's own timeouts are turned
off); if the worker does not answer by the deadline plus a grace period, the parent kills it and a
fresh one is started on the next request. A timeout or a crash counts as wrong and is reported.

Workers are fresh interpreters (``python -c``, as multiprocessing's ``spawn`` starts them: no forked copy
of a parent that may hold threads, CUDA or torch state) that import this module and math-verify only,
never the parent's ``__main__`` script: ``spawn`` re-runs that script's imports in every worker (the
whole training stack, torch and transformers, seconds per worker per evaluation). A closed grader hands
its idle workers to a process-wide spare pool, so the next grader of the process (the next evaluation)
starts none: the start-up is paid once per process. The spares stop at exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
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
                text_shortcut: bool = True, problem_text: str | None = None) -> tuple[str, str, str]:
    """Grade in this process's main thread with a fractional-second deadline: (reason, detail, rule)."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 1e-6))
    try:
        if mode == "exact":
            from sao_core.envs.exact import compare

            outcome = compare(answer, gold, text_shortcut=text_shortcut, problem=problem_text)
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
    """Worker loop: import math-verify, say ready, then grade (answer, gold, timeout, mode, text_shortcut, problem_text)
    requests; a ``{"modules": names}`` probe answers which of `names` this process has imported."""
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
        if isinstance(request, dict):   # a probe, never a grade request (those are tuples)
            conn.send({name: name in sys.modules for name in request["modules"]})
            continue
        answer, gold, timeout_s, mode, text_shortcut, problem_text = request
        try:
            outcome = _grade_here(answer, gold, timeout_s, mode, text_shortcut, problem_text)
        except _Deadline:  # the timer fired between the grading and its cancellation
            outcome = ("timeout", f"grading took longer than {timeout_s:g} s", "")
        conn.send(outcome)


def _worker_entry(fd: int) -> None:
    """What a worker process runs (see `_worker_command`): serve the connection at file descriptor `fd`."""
    from multiprocessing.connection import Connection

    _worker_main(Connection(fd))


def _worker_command(fd: int) -> list[str]:
    """The command line of a worker: this interpreter with the parent's import path, importing this module
    only. Not multiprocessing's spawn: spawn runs the parent's ``__main__`` script again in the child (as
    ``__mp_main__``), and a training or benchmark script imports torch and transformers at its top."""
    boot = (f"import sys; sys.path[:] = {list(sys.path)!r}; "
            f"from {__name__} import _worker_entry; _worker_entry({fd})")
    return [sys.executable, "-c", boot]


# --------------------------------------------------------------------------- parent side


class _Worker:
    """One worker process and its connection (a socket pair: multiprocessing's Connection protocol)."""

    def __init__(self) -> None:
        parent_conn, child_conn = multiprocessing.Pipe()
        fd = child_conn.fileno()
        try:
            self.process = subprocess.Popen(_worker_command(fd), pass_fds=(fd,), stdin=subprocess.DEVNULL)
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()  # the worker holds its own copy: its end closes when the worker dies
        self.conn = parent_conn
        self.pid = self.process.pid
        self.owner = os.getpid()   # a forked child of the parent must not stop the parent's workers
        self.ready = False
        _all_workers.add(self)

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

    def reusable(self) -> bool:
        """Ready, alive and with nothing unread on its connection (an EOF or a stray answer means it is not)."""
        try:
            return self.ready and self.process.poll() is None and not self.conn.poll(0)
        except (OSError, ValueError):
            return False

    def modules(self, names: Sequence[str], timeout_s: float) -> dict[str, bool]:
        """Which of the modules `names` the worker process has imported (for tests and benchmarks)."""
        self.conn.send({"modules": list(names)})
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"grader worker {self.pid} did not answer within {timeout_s:g} s")
        return self.conn.recv()

    def _wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for the process to end; True when it has ended (and is reaped)."""
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.terminate()
            if not self._wait(1.0):
                self.process.kill()
        self._wait(1.0)

    def stop(self) -> None:
        """Ask politely, then kill."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self._wait(0.5)
        self.kill()


#: Every worker this process started and not yet collected: stopped at exit even when their grader was not
#: closed (as multiprocessing's daemon processes were), since a worker stuck in a C-level computation never
#: notices that its parent has gone.
_all_workers: weakref.WeakSet[_Worker] = weakref.WeakSet()

#: The most idle workers kept for later graders of this process (each holds sympy: ~100 MB).
SPARE_LIMIT = 8
_spare_lock = threading.Lock()
_spares: list[_Worker] = []


def _take_spare() -> _Worker | None:
    """A started, ready worker left by a closed grader of this process, or None."""
    while True:
        with _spare_lock:
            if not _spares:
                return None
            worker = _spares.pop()
        if worker.reusable():
            return worker
        worker.kill()


def _keep_spare(worker: _Worker) -> bool:
    """Keep a healthy idle worker for the next grader of this process; False when it cannot be kept."""
    if worker.owner != os.getpid() or not worker.reusable():
        return False
    with _spare_lock:
        if len(_spares) >= SPARE_LIMIT:
            return False
        _spares.append(worker)
        return True


def spare_worker_pids() -> list[int]:
    """Process ids of the spare workers waiting for the next grader of this process (tests, benchmarks)."""
    with _spare_lock:
        return [worker.pid for worker in _spares]


def close_spare_workers() -> None:
    """Stop the spare workers (the next grader starts new ones)."""
    global _spares
    with _spare_lock:
        spares, _spares = _spares, []
    for worker in spares:
        worker.stop()


def _forget_workers_after_fork() -> None:
    """In a forked child: the parent's workers are the parent's (a fresh lock, in case one was held)."""
    global _spare_lock, _spares
    _spare_lock = threading.Lock()
    _spares = []
    _all_workers.clear()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


class MathGrader:
    """Thread-safe math answer grader backed by a lazily started pool of worker processes.

    `grade(answer, gold)` returns a GradeResult. Identical answers (up to whitespace and ``$``) match
    without a worker. Otherwise math-verify parses both (each wrapped in ``\\boxed{}``) and checks
    equivalence in a worker under `timeout_s` (per answer); a worker that has not answered after
    `timeout_s + kill_grace_s` is killed and replaced. Up to `max_workers` answers grade at once;
    more callers wait for a free worker. New workers come from the process's spares first (see the
    module docstring). `close()` hands the idle workers to the spares (`keep_warm`, the default) or
    stops them; a closed grader refuses work.
    """

    def __init__(
        self,
        max_workers: int = 2,
        timeout_s: float = 10.0,
        kill_grace_s: float = 1.0,
        startup_timeout_s: float = 120.0,
        keep_warm: bool = True,
    ):
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.startup_timeout_s = startup_timeout_s
        self.keep_warm = keep_warm
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._live = 0
        self._closed = False
        self.stats = {"graded": 0, "timeouts": 0, "errors": 0, "workers_started": 0, "workers_reused": 0,
                      "workers_killed": 0}

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
                    break
                self._cond.wait()
        try:
            return self._new_worker()  # outside the lock: starting a process takes a while
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _new_worker(self) -> _Worker:
        """A spare worker of this process (already started and warm) if there is one, else a new process."""
        spare = _take_spare()
        if spare is not None:
            self._count("workers_reused")
            return spare
        self._count("workers_started")
        return _Worker()

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
            elif self.keep_warm and _keep_spare(worker):
                return    # closed while this answer was graded: the worker is fine, keep it warm
            worker.kill()

    def warm_up(self, workers: int | None = None) -> list[str]:
        """Have `workers` (default and at most `max_workers`) workers started and ready now, so that later
        answers do not wait for a start-up (about a second: an interpreter and sympy's import; none for a
        spare). All are held at once, so exactly that many distinct workers are ready afterwards. Returns
        the problems of workers that did not start (they are dropped)."""
        count = min(self.max_workers, self.max_workers if workers is None else workers)
        held: list[_Worker] = []
        problems = []
        try:
            for _ in range(count):
                held.append(self._acquire())   # the processes start in parallel; readiness below
        finally:  # (also when a start failed: the ones started are released, not leaked)
            for worker in held:
                problem = worker.wait_ready(self.startup_timeout_s)
                if problem is not None:
                    problems.append(problem)
                self._release(worker, problem is None)
        return problems

    # -- grading ------------------------------------------------------------------------------------

    def grade(self, answer: str | None, gold: str, timeout_s: float | None = None, *,
              text_shortcut: bool = True, mode: str = "math_verify", problem_text: str | None = None) -> GradeResult:
        """Is `answer` (an extracted final answer, e.g. a box's content) equal to `gold`?

        `text_shortcut=False` skips the identical-text fast path, so math-verify (or the exact rules)
        decides every answer. `mode` is one of :data:`MODES`: ``math_verify`` (the default, training
        rewards) or ``exact`` (`sao_core.envs.exact`: reason ``unsettled`` when it cannot tell exactly).
        `problem_text` (mode ``exact``): the problem statement, which the exact rules read for the declared
        order of named tuples and the domain of a variable."""
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
                worker.conn.send((answer, gold, float(timeout), mode, text_shortcut, problem_text))
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
        """Hand the idle workers to the process's spares (`keep_warm`) or stop them. Idempotent; callers still
        grading hand theirs over (or have it killed) on return."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            if not (self.keep_warm and _keep_spare(worker)):
                worker.stop()

    def worker_pids(self) -> list[int]:
        """Process ids of the idle workers (for monitoring and tests)."""
        with self._cond:
            return [w.pid for w in self._idle]

    def worker_modules(self, names: Sequence[str], timeout_s: float = 10.0) -> dict[int, dict[str, bool]]:
        """Which of the modules `names` each idle worker has imported, by process id (tests, benchmarks:
        a worker must not hold the training stack)."""
        with self._cond:
            workers, self._idle = self._idle, []
        try:
            return {worker.pid: worker.modules(names, timeout_s) for worker in workers}
        finally:
            with self._cond:
                self._idle.extend(workers)
                self._cond.notify_all()

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


def _close_at_exit() -> None:
    """At exit: the default grader, the spares, then any worker of this process still running."""
    close_default_grader()
    close_spare_workers()
    for worker in list(_all_workers):
        if worker.owner == os.getpid() and worker.process.poll() is None:
            worker.kill()


atexit.register(_close_at_exit)
