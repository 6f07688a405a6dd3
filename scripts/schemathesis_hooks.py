"""Schemathesis hooks of scripts/fuzz_rollout_api.py: keep the compute of a fuzzed request small.

Values inside their valid range are lowered to other valid values (so a valid case stays valid and an invalid
one stays invalid): at most 2 samples and 16 new tokens for /v1/generate, a long-poll of at most 0.2 s for
/v1/trajectories; valid (positive) /v1/generate cases also keep at most 4 prompts.
"""

import schemathesis


def _positive(case) -> bool:
    meta = getattr(case, "meta", None)
    mode = getattr(getattr(meta, "generation", None), "mode", None)
    return bool(getattr(mode, "is_positive", False))


def _clamp(mapping, key, high, valid_max):
    if not isinstance(mapping, dict):
        return
    value = mapping.get(key)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return
        if high < number <= valid_max:
            mapping[key] = str(high)
    elif isinstance(value, int | float) and not isinstance(value, bool) and high < value <= valid_max:
        mapping[key] = high


def _bound_generate(body, positive: bool) -> None:
    if not isinstance(body, dict):
        return
    if positive and isinstance(body.get("prompts"), list) and len(body["prompts"]) > 4:
        body["prompts"] = body["prompts"][:4]
    _clamp(body, "n", 2, 1024)
    _clamp(body, "max_new_tokens", 16, 1_000_000)


@schemathesis.hook
def before_call(context, case, kwargs):
    path = case.operation.path
    # The request is built from `kwargs` (already rendered from the case): bound both.
    if path == "/v1/generate":
        _bound_generate(case.body, _positive(case))
        _bound_generate(kwargs.get("json"), _positive(case))
    if path == "/v1/trajectories":
        _clamp(case.query, "wait_s", 0.2, 300)
        _clamp(kwargs.get("params"), "wait_s", 0.2, 300)
