"""cpt_train: continued pre-training (next-token loss on raw text packed into max_tokens blocks); data kind cpt.

Written by :func:`components._factory.supervised_component` from the CPTConfig settings: it trains with
:func:`sao_core.training.trainer.train` into ``OUTPUT_ROOT/RUN_ID/cpt`` and resumes from its checkpoints.
"""

from components._factory import supervised_component

cpt_train = supervised_component("cpt", __name__, __doc__)
