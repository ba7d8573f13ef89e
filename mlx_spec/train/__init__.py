"""Train EAGLE-3 draft heads on this machine: `mlx-spec train eagle3`, `realign`, `export`.

    from mlx_spec.train.run import train_eagle3, realign
    model, tok = mlx_spec.load("mlx-community/SmolLM2-135M-Instruct")
    train_eagle3(model, tok, "./head")              # the target writes its own data
    drafter = mlx_spec.load_drafter("./head", model)

Modules: `data` (self-distillation, Magpie prompts, draft vocabulary), `ttt`
(the training forward, run through the drafter's own `Eagle3Head`, and the
loss), `trainer` (AdamW, schedule, clipping, exact-resume checkpoints),
`evaluate` (tau and speed-up through the real decode loop), `export` (the
head folder and the published layouts), `run` (the jobs end to end), `cli`.
See docs/training.md.
"""
