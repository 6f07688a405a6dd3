"""Environments: answer extraction and grading, tool_arith, math, math_python, the registry."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import threading
import time

import pytest

from sao_core.data.synthetic import tool_arith_sft_rows
from sao_core.envs import ENVIRONMENTS, Task, make_env, task_from_row
from sao_core.envs.grading import MathGrader, extract_boxed
from sao_core.envs.math_env import MathEnv
from sao_core.envs.math_python import MathPythonEnv
from sao_core.envs.tool_arith import ToolArithEnv, tool_arith_solution, tool_arith_tasks
from sao_core.sandbox.base import SandboxError, SandboxLimits


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(max_workers=1, timeout_s=10.0)
    yield g
    g.close()


def _call(expr: str) -> str:
    return f"<tool_call>calc {expr}</tool_call>"


def _chain_task(start: int, ops: list[tuple[str, int]], answer: int) -> Task:
    prompt = "Compute " + " ".join([str(start)] + [f"{op} {b}" for op, b in ops])
    return Task(id="t", env="tool_arith", prompt=[{"role": "user", "content": prompt}], answer=str(answer),
                metadata={"start": start, "ops": [list(o) for o in ops], "num_ops": len(ops)})


# --------------------------------------------------------------------------- extract_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\sqrt{\\frac{a}{b^{2}}}} end", "\\sqrt{\\frac{a}{b^{2}}}"),
        ("first \\boxed{1} then \\boxed{2} finally \\boxed{ 3 }", "3"),
        ("set \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("<think>maybe \\boxed{7}</think> I say \\boxed{8}", "8"),
        ("<think>maybe \\boxed{7}</think> no box after thinking", None),
        ("<think>still thinking \\boxed{7}", None),
        ("no box here", None),
        ("unbalanced \\boxed{12", None),
        ("complete \\boxed{5} then broken \\boxed{6", "5"),
        ("empty \\boxed{}", ""),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# --------------------------------------------------------------------------- MathGrader


def test_grader_equivalent_forms_mismatch_and_garbage(grader):
    assert grader.grade("0.5", "\\frac{1}{2}").correct
    assert grader.grade("\\sqrt{8}", "2\\sqrt{2}").correct
    r = grader.grade(" 42 ", "42")
    assert r.correct and r.reason == "match"
    r = grader.grade("3", "4")
    assert not r.correct and r.reason == "mismatch"
    r = grader.grade("}}{{\\frac", "4")
    assert not r.correct and r.reason == "unparseable"
    r = grader.grade(None, "4")
    assert not r.correct and r.reason == "no_answer"
    assert grader.grade_text("thus \\boxed{\\dfrac{2}{4}}", "0.5").correct


def test_grader_timeouts_are_wrong_and_reported(grader):
    # soft: the worker's own timer interrupts math-verify
    r = grader.grade("(x+1)^{250}+\\sin(x)", "(1+x)^{250}+\\sin(x)", timeout_s=1e-4)
    assert (r.correct, r.reason) == (False, "timeout")
    # hard: a worker that does not answer (stopped here) is killed after timeout + grace and replaced
    g = MathGrader(max_workers=1, timeout_s=5.0, kill_grace_s=0.2)
    try:
        assert g.grade("1", "1.0").correct  # starts the worker
        (pid,) = g.worker_pids()
        os.kill(pid, signal.SIGSTOP)
        r = g.grade("2", "2.0", timeout_s=0.2)
        assert (r.correct, r.reason) == (False, "timeout")   # answered, not hung on the stopped worker
        assert g.stats["workers_killed"] == 1
        # a crashed worker counts as an error, and the next answer gets a fresh worker
        assert g.grade("3", "3.0").correct
        (pid,) = g.worker_pids()
        os.kill(pid, signal.SIGKILL)
        r = g.grade("4", "4.0")
        assert (r.correct, r.reason) == (False, "error")
        assert g.grade("5", "5.0").correct
    finally:
        g.close()
    with pytest.raises(RuntimeError):
        g.grade("1", "2")


def test_grader_from_worker_threads(grader):
    results = {}

    def work(i):
        results[i] = grader.grade(f"\\frac{{{2 * i}}}{{2}}", str(i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[i].correct for i in range(1, 5)] == [True] * 4


# --------------------------------------------------------------------------- tool_arith


def test_tool_arith_scripted_episode_reaches_reward_1():
    # 12 + 7 * 3 - 5 left to right = ((12 + 7) * 3) - 5 = 52
    env = ToolArithEnv()
    task = _chain_task(12, [("+", 7), ("*", 3), ("-", 5)], 52)
    assert env.reset(task) == task.prompt
    for call, result in (("12 + 7", "19"), ("19 * 3", "57"), ("57 - 5", "52")):
        step = env.step(_call(call))
        assert (step.done, step.observation) == (False, result)
    end = env.step("The answer is \\boxed{52}.")
    assert (end.done, end.reward, end.finish_reason) == (True, 1.0, "stop")
    assert end.observation is None and end.info["calls"] == 3
    env.close()


def test_tool_arith_wrong_answer_errors_and_no_answer():
    env = ToolArithEnv()
    env.reset(_chain_task(12, [("+", 7), ("*", 3)], 57))
    bad = env.step("<tool_call>calculate twelve plus seven</tool_call>")
    assert not bad.done and bad.observation.startswith("error:")
    wrong = env.step(_call("12 * 7"))  # the first operation is + 7, not * 7
    assert not wrong.done and wrong.observation.startswith("error:")
    skipped = env.step(_call("19 * 3"))  # a later step before the first one
    assert skipped.observation.startswith("error:")
    assert env.step(_call("12 + 7")).observation == "19"
    end = env.step("\\boxed{58}")
    assert (end.done, end.reward, end.finish_reason) == (True, 0.0, "stop")

    env.reset(_chain_task(2, [("*", 3)], 6))
    end = env.step("I do not know.")
    assert (end.done, end.reward, end.finish_reason) == (True, 0.0, "stop")
    # a right answer without calling the tool still counts (reward is on the answer)
    env.reset(_chain_task(2, [("*", 3)], 6))
    assert env.step("\\boxed{6}").reward == 1.0


def test_tool_arith_max_turns_is_length():
    env = ToolArithEnv(max_turns=3)
    env.reset(_chain_task(1, [("+", 1)] * 5, 6))
    assert not env.step(_call("1 + 1")).done
    assert not env.step(_call("2 + 1")).done
    end = env.step(_call("3 + 1"))
    assert (end.done, end.reward, end.finish_reason, end.observation) == (True, 0.0, "length", None)
    with pytest.raises(RuntimeError):
        env.step("\\boxed{6}")


def test_tool_arith_latency_is_slept_and_reported(monkeypatch):
    """The drawn latency is slept (the reported tool seconds are at least it) and drawn, not constant; the
    distribution is checked on the drawn values, not on wall time (no upper bound that a loaded machine breaks)."""
    from sao_core.envs import tool_arith

    slept: list[float] = []
    real_sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(tool_arith.time, "sleep", recording_sleep)
    env = ToolArithEnv(latency_median_s=0.03, latency_sigma=0.5, seed=3)
    env.reset(_chain_task(1, [("+", 1)] * 4, 5))
    for x in range(1, 5):
        t0 = time.monotonic()
        step = env.step(_call(f"{x} + 1"))
        wall = time.monotonic() - t0
        assert step.tool_seconds >= slept[-1] * 0.99 and wall >= step.tool_seconds * 0.99
    assert len(slept) == 4 and len(set(slept)) == 4   # drawn, not constant
    assert 0.005 < statistics.median(slept) < 0.3     # log-normal around 0.03 s (seeded draws)
    no_latency = ToolArithEnv()
    no_latency.reset(_chain_task(1, [("+", 1)], 2))
    no_latency.step(_call("1 + 1"))
    assert len(slept) == 4                            # nothing slept without a latency


def test_tool_arith_tasks_long_tail_and_determinism():
    tasks = tool_arith_tasks(4000, seed=0, p_more=0.2, max_ops=30)
    counts = [t.metadata["num_ops"] for t in tasks]
    assert abs(statistics.mean(counts) - 5.0) < 0.3
    assert max(counts) <= 30 and sum(c >= 15 for c in counts) > 50 and counts.count(1) > 600
    t = tasks[0]
    assert t.env == "tool_arith" and t.answer == str(_eval(t.metadata["start"], t.metadata["ops"]))
    assert len(t.metadata["ops"]) == t.metadata["num_ops"]
    assert all(abs(int(t.answer)) <= 99 * 99 for t in tasks)
    same = tool_arith_tasks(50, seed=0, p_more=0.2)
    assert [(x.prompt, x.answer, x.metadata) for x in same] == [(x.prompt, x.answer, x.metadata) for x in tasks[:50]]
    assert [x.prompt for x in tool_arith_tasks(50, seed=1)] != [x.prompt for x in same]
    single = tool_arith_tasks(20, seed=2, p_more=1.0)
    assert all(x.metadata["num_ops"] == 1 and len(x.prompt[0]["content"].split()) == 4 for x in single)


def _eval(start, ops):
    value = start
    for op, b in ops:
        value = {"+": value + b, "-": value - b, "*": value * b}[op]
    return value


def test_tool_arith_solutions_solve_the_env():
    for task in tool_arith_tasks(30, seed=5, p_more=0.3):
        env = ToolArithEnv()
        env.reset(task)
        for message in tool_arith_solution(task)[1:]:
            if message["role"] == "assistant":
                step = env.step(message["content"])
            else:
                assert step.observation == message["content"]
        assert (step.done, step.reward) == (True, 1.0)


def test_tool_arith_from_prepared_row_without_metadata():
    task = task_from_row({"id": "r1", "env": "tool_arith", "prompt": "Compute 3*4", "answer": 12})
    env = make_env("tool_arith")
    env.reset(task)
    assert env.step(_call("3 * 4")).observation == "12"
    assert env.step(_call("3 + 4")).observation.startswith("error:")
    assert env.step("\\boxed{12}").reward == 1.0


def test_sft_rows_default_single_call_unchanged():
    rows = list(tool_arith_sft_rows(50, seed=0))
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert digest == "ad1a5274100da44a8aeb51bd5af1f13b3ad96f42d29e2fa2e9f1c3fce26bf4ba"
    rows = list(tool_arith_sft_rows(30, seed=7, max_operand=9))
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert digest == "8f2613c3b2c951aa5c738f004a74c56f81b6909224576f73146395f61079bfe6"
    assert all(len(r["messages"]) == 4 for r in rows)


def test_multi_call_sft_rows_render_with_embedded_template(sao_cache):
    from sao_core.models import load_tokenizer

    tokenizer = load_tokenizer("embedded:tiny", sao_cache)
    rows = list(tool_arith_sft_rows(40, seed=3, p_more=0.25))
    assert rows == list(tool_arith_sft_rows(40, seed=3, p_more=0.25))
    multi = [r for r in rows if len(r["messages"]) > 4]
    assert multi and max(len(r["messages"]) for r in rows) >= 10
    messages = multi[0]["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    calls = [m["content"] for m in messages if m["role"] == "assistant"][:-1]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert len(calls) == len(results) >= 2
    for call, result in zip(calls, results, strict=True):
        assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>tool\n<tool_response>{result}</tool_response>" in text
    assert messages[0]["content"].endswith("(left to right)")
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    learned = tokenizer.decode([t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m])
    assert learned == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


# --------------------------------------------------------------------------- math


def test_math_env_correct_and_incorrect(grader):
    task = Task(id="m", env="math", prompt=[{"role": "user", "content": "Half of one?"}], answer="\\frac{1}{2}")
    env = MathEnv(grader=grader)
    assert env.reset(task) == task.prompt
    r = env.step("<think>1/2 = 0.5</think>The answer is \\boxed{0.5}.")
    assert (r.done, r.reward, r.finish_reason, r.info["grade"]) == (True, 1.0, "stop", "match")
    env.reset(task)
    r = env.step("The answer is \\boxed{0.25}.")
    assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "stop") and r.info["grade"] == "mismatch"
    env.reset(task)
    r = env.step("no idea")
    assert (r.reward, r.info["grade"]) == (0.0, "no_answer")
    env.close()


# --------------------------------------------------------------------------- math_python


def _python_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def test_math_python_episode_with_local_sandbox(grader):
    from sao_core.sandbox.local import LocalSandbox

    made = []

    def factory():
        made.append(LocalSandbox(SandboxLimits(wall_seconds=5)))
        return made[-1]

    env = MathPythonEnv(factory, call_timeout_s=1.0, grader=grader)
    task = Task(id="p", env="math_python", prompt=[{"role": "user", "content": "What is 6 * 7?"}], answer="42")
    messages = env.reset(task)
    assert messages[0]["role"] == "system" and messages[1:] == task.prompt
    assert made == []  # the sandbox starts with the first call
    r = env.step("Let me compute.\n" + _python_call("print(6 * 7)"))
    assert (r.done, r.observation) == (False, "42\n") and r.tool_seconds > 0
    r = env.step(_python_call("print(6 *"))
    assert not r.done and "SyntaxError" in r.observation and r.observation.endswith("[exit code 1]")
    r = env.step(_python_call("print('start', flush=True)\nwhile True:\n    pass"))
    assert not r.done and r.observation.endswith("[timed out after 1 s]")   # ended by its timeout, not hung
    r = env.step('<tool_call>{"name": "python", "arguments": {"code": </tool_call>')
    assert not r.done and r.observation.startswith("error:") and "JSON" in r.observation
    r = env.step('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>')
    assert not r.done and r.observation.startswith("error:") and "unknown tool" in r.observation
    r = env.step("So it is \\boxed{42}.")
    assert (r.done, r.reward, r.finish_reason) == (True, 1.0, "stop")
    assert len(made) == 1
    workdir = made[0].workdir
    env.close()
    assert not os.path.exists(workdir)


class _BrokenSandbox:
    def __init__(self):
        self.closed = False

    def exec(self, command, timeout_s=None, stdin=None):
        raise SandboxError("pod lost")

    def write_file(self, path, data):
        pass

    def read_file(self, path):
        return b""

    def close(self):
        self.closed = True


def test_math_python_sandbox_failure_and_length(grader):
    box = _BrokenSandbox()
    env = MathPythonEnv(lambda: box, grader=grader)
    env.reset(Task(id="p", env="math_python", prompt=[{"role": "user", "content": "x"}], answer="1"))
    r = env.step(_python_call("print(1)"))
    assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "tool_error") and "pod lost" in r.info["error"]
    env.close()
    assert box.closed

    env = MathPythonEnv(lambda: _BrokenSandbox(), max_turns=2, grader=grader)
    env.reset(Task(id="p", env="math_python", prompt=[{"role": "user", "content": "x"}], answer="1"))
    assert env.step("<tool_call>not json</tool_call>").observation.startswith("error:")
    r = env.step("<tool_call>not json</tool_call>")
    assert (r.done, r.finish_reason) == (True, "length")


# --------------------------------------------------------------------------- registry


def test_registry_and_task_from_row():
    assert ENVIRONMENTS == ("math", "math_python", "swe", "tool_arith")
    with pytest.raises(ValueError, match="math, math_python, swe, tool_arith"):
        make_env("chess")
    assert isinstance(make_env("tool_arith", max_turns=4), ToolArithEnv)
    assert make_env("math").name == "math"
    env = make_env("math_python", sandbox_limits=SandboxLimits(wall_seconds=2))
    assert env.name == "math_python" and env.sandbox is None
    env.close()
    with pytest.raises(TypeError):
        make_env("tool_arith", no_such_option=1)

    row = {
        "id": "imo-1",
        "prompt": [{"role": "user", "content": "Find x."}],
        "env": "math",
        "answer": "3",
        "tests": None,
        "metadata": {"category": "Algebra"},
    }
    task = task_from_row(row)
    assert task == Task(id="imo-1", env="math", prompt=[{"role": "user", "content": "Find x."}], answer="3",
                        tests=None, metadata={"category": "Algebra"})
    task.prompt[0]["content"] = "changed"
    assert row["prompt"][0]["content"] == "Find x."  # a copy
    swe = task_from_row({"id": 7, "prompt": "fix it", "env": "swe", "tests": ["t::a"], "answer": None})
    assert (swe.id, swe.prompt, swe.tests, swe.metadata) == ("7", [{"role": "user", "content": "fix it"}], ["t::a"], {})
    for bad in ({"prompt": "x", "env": "math"}, {"id": "a", "prompt": [], "env": "math"},
                {"id": "a", "prompt": "x", "env": "math", "tests": "t"}):
        with pytest.raises(ValueError):
            task_from_row(bad)


def test_task_from_prepared_rl_record():
    from sao_core.data.schemas import normalize_rl

    record = normalize_rl({"prompt": "Compute 2 + 3", "env": "tool_arith", "answer": 5, "source": "synthetic"},
                          ENVIRONMENTS)
    task = task_from_row(json.loads(json.dumps(record)))
    assert (task.env, task.answer, task.metadata) == ("tool_arith", "5", {"source": "synthetic"})
    assert task.id == record["id"]
