"""One training step of one method on a model with a real vocabulary (151,936) and a tiny width, in its own
process; prints one JSON line per method: {"method", "positions", "base_rss_mb", "peak_rss_mb", "seconds"}.

    python tests/scripts/memory_step_worker.py METHODS [POSITIONS] [--unchunked]

METHODS: comma-separated, of sft | cpt | dpo | gkd | grpo | sao, run one after the other in this process
(peak_rss_mb is the process's peak so far: a method that materialises [N, V] logits raises it). `--unchunked` sets the chunk budget so high that one chunk holds
every position (the full [N, V] logits), which shows what the memory bound in the test catches.

Every row is 1,024 tokens whose last 256 are scored (loss / action tokens): the forward runs over all 8,192
positions, the output layer over 2,048 of them (2,048 x 151,936 float32 logits would still be 1.24 GB, all
8,192 positions 4.98 GB).
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

VOCAB = 151_936
SCORED = 256        # of each 1,024-token row: loss / action tokens (the output layer runs on these only)


def rss_mb() -> float:
    """Peak resident memory of this process's own address space (VmHWM, MB). Not getrusage's ru_maxrss: that is
    preserved across execve, so a worker started from a large pytest process (e.g. after a test that loaded a real
    model) would report the parent's size from its first line."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024   # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def lm(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                        tie_word_embeddings=False))


class Ids:
    """The two token ids the methods read from a tokenizer."""

    pad_token_id = 0
    eos_token_id = 1


def supervised_step(method: str, model, rows: int, width: int) -> None:
    from sao_core.training.chat_batch import EncodedChat
    from sao_core.training.config import METHOD_CONFIGS
    from sao_core.training.core import build_optimizer, clip_and_step
    from sao_core.training.distributed import DistContext
    from sao_core.training.methods import METHODS
    from sao_core.training.methods.dpo import DPOExample
    from sao_core.training.methods.gkd import GKDExample

    g = torch.Generator().manual_seed(1)

    def chat() -> EncodedChat:
        ids = torch.randint(2, VOCAB, (width,), generator=g).tolist()
        return EncodedChat(ids, [0] * (width - SCORED) + [1] * SCORED)

    extra = {"teacher_model": "unused", "on_policy_fraction": 0.0} if method == "gkd" else {}
    config = METHOD_CONFIGS[method](data="unused", output="unused", batch_size=rows, **extra)
    impl = METHODS[method](config, Ids(), DistContext())
    if method == "dpo":
        # Chosen and rejected each half the rows, so a step holds `rows × width` positions in all.
        batch = [DPOExample(chat(), chat()) for _ in range(rows // 2)]
        impl.setup(model, batch)
    elif method == "gkd":
        batch = [GKDExample([2, 3], chat()) for _ in range(rows)]
        impl.teacher = lm(seed=5).eval().requires_grad_(False)
    else:
        batch = [chat() for _ in range(rows)]
    optimizer = build_optimizer(model.parameters(), 1e-4, 0.0)
    loss, _ = impl.loss(model, batch, step=0, training=True)
    loss.backward()
    clip_and_step(optimizer, model.parameters(), 1.0)


def rl_step(method: str, model, rows: int, width: int) -> None:
    import tempfile

    from sao_core.learner.batch import collate
    from sao_core.learner.config import RLConfig
    from sao_core.learner.updates import Updater
    from sao_core.models.value import ValueModel
    from sao_core.rollout.trajectory import Trajectory

    g = torch.Generator().manual_seed(2)
    critic = None
    if method == "sao":
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            critic = ValueModel.from_pretrained(tmp)
    trajectories = []
    for i in range(rows):
        ids = torch.randint(2, VOCAB, (width,), generator=g).tolist()
        mask = [0] * (width - SCORED) + [1] * SCORED
        trajectories.append(Trajectory(
            id=f"t{i}", prompt_id=f"p{i // 2}", env="tool_arith", token_ids=ids, action_mask=mask,
            rollout_logprobs=[-11.9 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
            reward=float(i % 2), num_turns=1, finish_reason="stop", metadata={"epoch": 0}))
    config = RLConfig(data="unused", output="unused", method=method, batch_size=rows, group_size=2,
                      critic_warmup_steps=0, eps_low=0.9, eps_high=100.0)
    Updater(config, model, critic).step(collate(trajectories, Ids.pad_token_id), 0)


def main(argv: list[str]) -> int:
    torch.set_num_threads(2)
    methods = argv[0].split(",")
    positions = int(argv[1]) if len(argv) > 1 and not argv[1].startswith("--") else 8192
    if "--unchunked" in argv:
        import sao_core.objectives.chunked as chunked

        chunked.LOGIT_CHUNK_ELEMENTS = 2 ** 40
    width = 1024
    rows = positions // width
    for method in methods:
        model = lm(seed=0)
        base = rss_mb()
        began = time.perf_counter()
        if method in ("sft", "cpt", "dpo", "gkd"):
            supervised_step(method, model, rows, width)
        else:
            rl_step(method, model, rows, width)
        print(json.dumps({"method": method, "positions": rows * width, "base_rss_mb": round(base, 1),
                          "peak_rss_mb": round(rss_mb(), 1), "seconds": round(time.perf_counter() - began, 2)}),
              flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
