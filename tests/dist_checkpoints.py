"""Tiny checkpoints of the sharded-target tests (tests/test_distributed.py,
tests/test_dist_serve.py): saved random mlx-lm models, heads reading their layers, and a
DeepSeek-V4-Flash-0731 checkpoint with DSpark stages."""

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import tiny


def save(folder: Path, model) -> Path:
    folder.mkdir(parents=True)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tiny.tokenizer(eos=0)._tokenizer.save_pretrained(str(folder))
    return folder


def eagle3_head(root: Path, target: Path) -> Path:
    """A random EAGLE-3 head (its proposals depend on every tap) reading the embedding and
    the outputs of layers 1, 2 and 3 of a 4-layer target: taps on every pipeline stage,
    on a stage's last layer (whose wrapper sends on) and on a one-layer stage (3 ranks)."""
    from converters.eagle import v3
    from eagle_fixtures import eagle3_checkpoint

    eagle3_checkpoint(root / f"{target.name}_src", 64, tiny.VOCAB, heads=4, kv_heads=4, n_taps=4,
                      config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3, 4]})
    v3.convert(root / f"{target.name}_src", root / f"{target.name}_head", target)
    return root / f"{target.name}_head"


def dflash_head(root: Path, target: Path) -> Path:
    """A random z-lab DFlash head reading layers 0 and 2 of a 4-layer target: one tap on
    each stage of a 2-rank split, drafting blocks (not chains) from them."""
    import numpy as np

    import dflash_synth as S
    from converters import dflash

    w = S.network_weights(np.random.default_rng(0), 2, 2)
    src = S.save_checkpoint(root / f"{target.name}_dflash_src", S.zlab_config(2, [0, 2], 4), w)
    return dflash.convert(src, root / f"{target.name}_dflash", target)


# A tiny DeepSeek-V4-Flash-0731 checkpoint (FP8/FP4 as published) with random DSpark stages
# reading layers 1..3 (both pipeline stages); expert widths of 64 so that a 2-rank tensor
# split keeps whole 32-value quantization groups.
V4 = {"moe_intermediate_size": 64, "dspark_block_size": 5, "dspark_target_layer_ids": [1, 2, 3],
      "dspark_noise_token_id": 95, "dspark_markov_rank": 4}


def v4_checkpoint(folder: Path) -> Path:
    import numpy as np

    import deepseek_v4_synth as S
    import dspark_v4_ref as R

    config = {**S.CONFIG, **V4}
    trunk, _ = S.pack(S.native(S.language_model(config, seed=1)))
    stages, _ = R.packed(R.stage_tensors(np.random.default_rng(0), config, "0731", 3, 4), tile=128)
    return S.write(folder, config, {**trunk, **stages})
