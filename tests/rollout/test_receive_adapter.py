"""`weights.receive_adapter`, the receiving side of a LoRA adapter handed over in memory (issue 37), without an
engine: what it returns (its own copies of the tensors and their digest) and what it refuses before anything is
applied: full weights handed to it, an adapter update that names a tensor twice, and a tensor changed after the
sender's digest. Each refusal is a WeightUpdateError (not WeightsCorrupted: nothing was applied) naming the
version and what was wrong."""

from __future__ import annotations

import re

import pytest
import torch

from sao_core.rollout.weights import WeightsCorrupted, WeightUpdate, WeightUpdateError, receive_adapter

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """A rank-2 adapter's two matrices on an 8-wide projection (fp32, as a learner sends them)."""
    generator = torch.Generator().manual_seed(seed)
    return {A: torch.randn(2, 8, generator=generator), B: torch.randn(8, 2, generator=generator)}


def test_an_adapter_update_is_received_as_copies_with_the_senders_digest():
    sent = _weights(0)
    update = WeightUpdate.adapter(5, sent, CONFIG)
    weights, digest = receive_adapter(update)
    assert digest == update.digest and digest.startswith(("xxh3-128:", "blake2b-128:"))
    assert list(weights) == [A, B] and all(torch.equal(weights[n], sent[n]) for n in sent)
    sent[A].add_(1.0)   # the sender trains on once the receiver answered: what was received stays
    assert not torch.equal(weights[A], sent[A])


def test_full_weights_handed_to_the_adapter_receiver_are_refused():
    update = WeightUpdate(4, list(_weights(0).items()))   # no adapter config: full weights
    with pytest.raises(WeightUpdateError, match=r"^weight update v4 is full weights, not a LoRA adapter$") as err:
        receive_adapter(update)
    assert not isinstance(err.value, WeightsCorrupted)


def test_an_adapter_update_that_names_a_tensor_twice_is_refused():
    """The sender's digest covers both tensors, so the digest check alone would pass and the second tensor
    would silently replace the first."""
    first, second = _weights(0), _weights(1)
    update = WeightUpdate(3, [(A, first[A]), (B, first[B]), (A, second[A])], adapter_config=CONFIG)
    assert update.digest   # the sender hashed all three
    with pytest.raises(WeightUpdateError, match=r"^adapter update v3 names a tensor twice$") as err:
        receive_adapter(update)
    assert not isinstance(err.value, WeightsCorrupted)


def test_an_adapter_tensor_changed_after_the_senders_digest_is_refused_naming_both_digests():
    update = WeightUpdate.adapter(6, _weights(0), CONFIG)
    expected = update.digest   # computed by the sender's thread: now the tensor changes "in transit"
    update.tensors[1][1].mul_(2.0)
    with pytest.raises(WeightUpdateError, match=rf"^adapter update v6 did not arrive intact: the sender's digest "
                                                rf"is {re.escape(expected)}, the tensors received hash to \S+$") as err:
        receive_adapter(update)
    assert not isinstance(err.value, WeightsCorrupted)
