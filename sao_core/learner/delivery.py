"""Delivery check of a weight push: after a rollout service loads a version, its log-probs for a fixed probe
sequence must equal the learner's at that version (within `delivery_tolerance`), or the run stops with an
error naming the service. A push the engine silently ignored (an adapter never applied, the wrong base, a
corrupted or half-loaded tensor) is caught here, before trajectories of another policy are trained on.

The probe (:func:`chat_probe`) is a fixed short chat exchange written here (a user question and an assistant
answer in plain English with a little arithmetic), run through the tokenizer's chat template (plain
"User: / Assistant:" text when the tokenizer has none). The sequence is cut right after its first
`delivery_check_tokens` assistant tokens (the conversation is repeated when the answer is shorter), and
those tokens are the ones scored: `start` is the first assistant token, so every token compared is one the
model finds plausible given a real context, as the tokens it samples are. It is a pure function of the
tokenizer: the same ids in every process of a run and in every run with that tokenizer. Only the learner
builds it; the services get the ids.

Why not random ids (the probe before): a bf16 engine rounds the logits of tokens the model finds very
unlikely the most, so on random ids a bf16 engine that did get the weights differed from the float32 learner
by 0.29 nats/token on average (max 3.05; SmolLM2-135M on an H200) and the run stopped. On CPU the same model
gives 0.06-0.33 (max 4.1) on random ids, above the old tolerance 0.1 in 97 of 100 pushes, and 0.021-0.048 (max
0.29) on this probe (`bench/delivery_probe.py`, `bench/results/delivery_probe.json`).

Scored from the first assistant token, not position 1: the tokens before it are the chat template's markup
and a system prompt some templates add, the same in every run; the answer is what the policy samples and
trains on, so a probe of `delivery_check_tokens` tokens spends them where the weights' differences show (and
the context before them makes them plausible, as sampled tokens are).

Precision. The learner scores the probe as it trains: float32 master weights under its own autocast
(`precision`: a bf16 autocast on a GPU by default, none on CPU); the engine scores it with its own weights
(bf16 on a GPU, float32 on CPU by default) and kernels. The learner does not try to reproduce the engine's
arithmetic: it does not know it (a remote service's dtype and kernels, vLLM's fused ones), and it would gain
little: a bf16 autocast of float32 weights is not a bf16 model (norms, residual adds and the softmax stay
float32), and on this probe it leaves the gap as it was (SmolLM2, 100 pushes: median 0.031 against 0.030
for the float32 learner, worst 0.047 against 0.048). Instead `delivery_tolerance` (0.15) is set from
measurement to cover the float32-vs-bf16 difference on this probe with a margin of 3x the worst mean seen,
while the faults the check is for exceed it: a zeroed MLP layer 0.56-0.63, that layer doubled 0.32-0.35,
another base model 9.4, an engine that never loaded any of 100 pushes at lr 1e-5 0.19.

What a probe cannot catch: a service one version (or ten) behind at the learning rates RL uses (1e-6 to 1e-5)
scores the probe within bf16 noise of the current weights (SmolLM2 at AdamW lr 1e-5: 0.031 and 0.041, the
same as a correct delivery); the version number the service answers and the digest of the weights sent are
what catch that. Nor a small corruption (one layer's weight scaled by 1.1: 0.03-0.05), nor an adapter not
applied until it has moved the policy by more than the tolerance (its B matrices start at zero: SmolLM2 with
rank 16 at lr 1e-5, 0.040 after 50 steps; at lr 1e-4, 0.157 after 50 steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_core.learner.errors import LearnerError

#: The built-in conversation of the probe (ordinary English and a little arithmetic; ASCII only so that every
#: tokenizer encodes it). Changing it changes every run's probe: keep it fixed.
PROBE_QUESTION = "What is the sum of the first ten positive whole numbers? Is there a quick way to find it?"
PROBE_ANSWER = (
    "Yes, there is a quick way. Write the numbers in pairs from the outside in: 1 + 10 = 11, 2 + 9 = 11, "
    "3 + 8 = 11, 4 + 7 = 11 and 5 + 6 = 11. There are five pairs and each of them adds up to 11, so the sum is "
    "5 * 11 = 55.\n\nThe same idea works for any count. For the numbers from 1 to n there are n / 2 pairs that "
    "each add up to n + 1, so the sum is n(n + 1) / 2. For example, the numbers from 1 to 100 add up to "
    "100 * 101 / 2 = 5050. This is the trick the young Gauss is said to have used at school."
)


@dataclass(frozen=True)
class Probe:
    """The learner's log-probs of `token_ids[start:]` at weights `version`; a service passes when the mean
    absolute difference of its own is at most `tolerance` (nats per token)."""

    token_ids: list[int]
    start: int
    logprobs: list[float]
    version: int
    tolerance: float


def _ids(encoded) -> list[int]:
    """Token ids from what a tokenizer call returns (a list, a BatchEncoding / dict, a tensor)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):   # a batch of one
        encoded = encoded[0]
    return [int(i) for i in encoded]


def _conversation(tokenizer) -> tuple[list[int], list[int]]:
    """(the prompt up to the first assistant token, the whole exchange) as token ids."""
    if getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": PROBE_QUESTION}]
        prompt = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": PROBE_ANSWER}],
                                             tokenize=True)
        return _ids(prompt), _ids(full)
    prompt = f"User: {PROBE_QUESTION}\nAssistant:"
    return _ids(tokenizer(prompt)), _ids(tokenizer(f"{prompt} {PROBE_ANSWER}\n"))


def chat_probe(tokenizer, length: int) -> tuple[list[int], int]:
    """(token ids, start): the built-in chat exchange (see the module) tokenized with `tokenizer`'s chat template
    (plain text without one), cut so that exactly `length` tokens from `start`, the first assistant token, are
    scored; the conversation is repeated when its answer is shorter. Deterministic: a function of the tokenizer."""
    if length < 1:
        raise ValueError(f"probe length must be >= 1, got {length}")
    prompt, full = _conversation(tokenizer)
    start = 0   # the first assistant token: where the prompt and the whole exchange part (a template may
    while start < min(len(prompt), len(full)) and prompt[start] == full[start]:   # render the turn's opening
        start += 1                                                                  # differently once answered)
    start = max(start, 1)
    if len(full) <= start:
        raise ValueError("the probe conversation tokenizes to no assistant tokens")
    ids = list(full)
    while len(ids) < start + length:
        ids += full
    return ids[:start + length], start


def probe_tokens(vocab: int, length: int, seed: int) -> list[int]:
    """`length` random token ids in [0, vocab) from a generator seeded with `seed`: the probe before
    :func:`chat_probe` (kept for the benchmarks that measure why it was replaced)."""
    generator = torch.Generator().manual_seed(seed + 7_919)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def learner_logprobs(model, token_ids: list[int], start: int, autocast_ctx, device) -> list[float]:
    """The policy's log-probs of `token_ids[start:]` (no gradient; a collective forward under FSDP2)."""
    from sao_core.training.forward import model_logprobs

    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_ctx:
            logp, _ = model_logprobs(model, ids)
    finally:
        model.train(was_training)
    return logp[0, start:].float().cpu().tolist()


def differences(theirs: list[float], mine: list[float]) -> dict[str, float]:
    """{"mean", "max"} |theirs − mine| per token."""
    diffs = [abs(a - b) for a, b in zip(theirs, mine, strict=True)]
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs)}


def compare(answer: dict, probe: Probe, url: str) -> dict[str, float]:
    """{"mean", "max"} |service − learner| over the probe; LearnerError naming the service when the service
    scored another version or the mean exceeds the tolerance."""
    theirs = answer.get("logprobs") or []
    if answer.get("version") != probe.version or len(theirs) != len(probe.logprobs):
        raise LearnerError(f"delivery check: rollout service {url} scored the probe at version "
                           f"{answer.get('version')} ({len(theirs)} log-probs); the learner pushed version "
                           f"{probe.version} ({len(probe.logprobs)} expected)")
    found = differences(theirs, probe.logprobs)
    if not found["mean"] <= probe.tolerance:
        raise LearnerError(
            f"delivery check: rollout service {url} does not serve the learner's weights version {probe.version}: "
            f"its log-probs of the {len(theirs)}-token probe differ from the learner's by {found['mean']:.4g} nats "
            f"per token on average (max {found['max']:.4g}; delivery_tolerance {probe.tolerance:g}). The weights "
            "it loaded are not the ones pushed (an adapter not applied, another base model, a corrupted tensor); "
            "stopping rather than training on another policy's trajectories")
    return found
