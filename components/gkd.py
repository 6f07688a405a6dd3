"""gkd_train: generalised knowledge distillation from a teacher sharing the tokenizer; data kind sft.

Written by :func:`components._factory.supervised_component` from the GKDConfig settings: it trains with
:func:`sao_core.training.trainer.train` into ``OUTPUT_ROOT/RUN_ID/gkd`` and resumes from its checkpoints.
``teacher_model`` is a required parameter of its own.
"""

from components._factory import supervised_component

gkd_train = supervised_component(
    "gkd", __name__, __doc__, required=("teacher_model",),
    options_example='{"beta": 0.5, "temperature": 1.0, "on_policy_fraction": 0.5} (beta 0 = forward KL, '
                    '1 = reverse KL)')
