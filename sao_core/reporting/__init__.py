"""Reports shared by the evaluator and the training core: SVG charts (`plots`), HTML helpers (`html`) and
the training report (`training`). This floor imports only `sao_core.storage` (below every user of it), so
the trainer, the learner and the evaluator can all call it."""
