"""sft_train: supervised fine-tuning on chat messages (cross-entropy on assistant tokens); data kind sft.

Written by :func:`components._factory.supervised_component` from the SFTConfig settings: it trains with
:func:`sao_core.training.trainer.train` into ``OUTPUT_ROOT/RUN_ID/sft`` and resumes from its checkpoints.
"""

from components._factory import supervised_component

sft_train = supervised_component("sft", __name__, __doc__)
