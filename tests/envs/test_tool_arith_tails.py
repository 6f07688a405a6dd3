"""tool_arith's benchmark option `fixed_turns`: episode lengths set by the task, not by the policy."""

from __future__ import annotations

import time

from sao_core.envs import Task, make_env
from sao_core.envs.tool_arith import ToolArithEnv, tool_arith_solution, tool_arith_tasks


def _chain_task(start, ops, answer, with_metadata=True):
    text = f"Compute {start}" + "".join(f" {op} {b}" for op, b in ops) + (" (left to right)" if len(ops) > 1 else "")
    meta = {"start": start, "ops": [list(o) for o in ops], "num_ops": len(ops)} if with_metadata else {}
    return Task(id="t", env="tool_arith", prompt=[{"role": "user", "content": text}], answer=str(answer),
                metadata=meta)


def _call(expr: str) -> str:
    return f"<tool_call>calc {expr}</tool_call>"


def test_default_is_unchanged_an_early_answer_ends_the_episode():
    env = ToolArithEnv()
    env.reset(_chain_task(12, [("+", 7), ("*", 3)], 57))
    end = env.step("\\boxed{57}")
    assert (end.done, end.reward, end.finish_reason) == (True, 1.0, "stop")
    assert make_env("tool_arith").fixed_turns is False


def test_fixed_turns_solved_episode_is_the_solution_length():
    for task in tool_arith_tasks(20, seed=4, p_more=0.3):
        env = make_env("tool_arith", fixed_turns=True)
        env.reset(task)
        turns = [m["content"] for m in tool_arith_solution(task)[1:] if m["role"] == "assistant"]
        assert len(turns) == task.metadata["num_ops"] + 1
        for i, text in enumerate(turns):
            step = env.step(text)
            assert step.done == (i == len(turns) - 1)
        assert (step.reward, step.finish_reason) == (1.0, "stop")


def test_fixed_turns_scripted_tool_answers_the_next_operation_whatever_the_turn_says():
    env = ToolArithEnv(fixed_turns=True)
    env.reset(_chain_task(12, [("+", 7), ("*", 3)], 57))    # 3 turns
    early = env.step("\\boxed{57}")                        # an early answer does not end the episode
    assert (early.done, early.observation) == (False, "19")
    wrong = env.step(_call("5 * 5"))                         # wrong operands: still the chain's 2nd result
    assert (wrong.done, wrong.observation, wrong.info["errors"]) == (False, "57", 1)
    end = env.step("The answer is \\boxed{57}.")
    assert (end.done, end.reward, end.finish_reason, end.info["outcome"]) == (True, 1.0, "stop", "match")
    assert (end.info["calls"], end.info["errors"]) == (1, 1)

    env.reset(_chain_task(12, [("+", 7)], 19))                 # 2 turns; the last turn's answer is graded
    assert env.step("\\boxed{19}").observation == "19"
    end = env.step("\\boxed{20}")
    assert (end.done, end.reward, end.info["outcome"]) == (True, 0.0, "mismatch")

    env.reset(_chain_task(2, [("*", 3)], 6))                   # the last turn calls instead of answering
    assert env.step("hmm").observation == "6"
    end = env.step(_call("2 * 3"))
    assert (end.done, end.reward, end.info["outcome"]) == (True, 0.0, "no_answer")


def test_fixed_turns_malformed_calls_are_counted_not_shown():
    env = ToolArithEnv(fixed_turns=True)
    env.reset(_chain_task(1, [("+", 1)] * 3, 4))               # 4 turns
    assert env.step(_call("1 + 1")).observation == "2"
    bad = env.step("<tool_call>calc two plus one</tool_call>")
    assert (bad.observation, bad.info["errors"]) == ("3", 1)
    assert env.step(_call("3 + 1")).observation == "4"
    end = env.step(_call("4 + 1"))                             # the last turn ends the episode, even with a call
    assert (end.done, end.reward, end.finish_reason) == (True, 0.0, "stop")


def test_fixed_turns_capped_by_max_turns_and_read_from_the_prompt():
    env = ToolArithEnv(fixed_turns=True, max_turns=3)
    env.reset(_chain_task(1, [("+", 1)] * 9, 10))
    assert not env.step("a").done and not env.step("b").done
    assert env.step("c").done
    env = ToolArithEnv(fixed_turns=True)
    env.reset(_chain_task(5, [("-", 1), ("-", 1)], 3, with_metadata=False))   # chain parsed from the text
    assert not env.step("x").done and not env.step("y").done
    assert env.step("\\boxed{3}").done


def test_fixed_turns_without_a_chain_falls_back_to_normal_episodes():
    env = ToolArithEnv(fixed_turns=True)
    env.reset(Task(id="q", env="tool_arith", prompt=[{"role": "user", "content": "What is six?"}], answer="6"))
    end = env.step("\\boxed{6}")
    assert (end.done, end.reward) == (True, 1.0)


def test_fixed_turns_every_non_final_turn_waits_for_the_tool():
    env = ToolArithEnv(fixed_turns=True, latency_median_s=0.02)
    env.reset(_chain_task(1, [("+", 1)] * 2, 3))
    t0 = time.monotonic()
    step = env.step("no call here")
    assert step.tool_seconds >= 0.019 and time.monotonic() - t0 >= 0.019
    assert env.step(_call("1 + 1")).tool_seconds >= 0.019
    final = env.step("\\boxed{3}")
    assert final.done and final.reward == 1.0 and final.tool_seconds == 0.0
