"""dpo_train: direct preference optimisation (sigmoid DPO on summed response log-probs); data kind dpo.

Written by :func:`components._factory.supervised_component` from the DPOConfig settings: it trains with
:func:`sao_core.training.trainer.train` into ``OUTPUT_ROOT/RUN_ID/dpo`` and resumes from its checkpoints.
``reference_model`` has a parameter of its own.
"""

from components._factory import supervised_component

dpo_train = supervised_component(
    "dpo", __name__, __doc__, data="Prepared dataset of kind dpo (prompt, chosen, rejected).",
    optional=("reference_model",), options_example='{"beta": 0.1, "schedule": "cosine", "checkpoint_every": 100}')
