"""The vLLM test modules' shared event loop and tiny vLLM engine (tests/vllm_fixtures.py; module-scoped: one engine
per module that asks for it)."""

from vllm_fixtures import engine, loop  # noqa: F401  (fixtures)
