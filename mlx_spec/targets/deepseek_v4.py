"""DeepSeek-V4-Flash (`model_type: deepseek_v4`, e.g. DeepSeek-V4-Flash-0731) as a target.

mlx-lm 0.32.2 has no `deepseek_v4` model (only DeepSeek-V4.1's `deepseek_v41`);
mlx-vlm has a maintained one (`mlx_vlm.models.deepseek_v4`, >= 0.7.10). mlx-spec runs
that implementation, installed with `pip install -e '.[deepseek-v4]'`, on an
instance it wraps, and adds only what speculative decoding needs:

* **Loading the checkpoint as DeepSeek publishes it.** FP8 e4m3 weights with one
  ue8m0 scale per 128x128 tile become MLX mxfp8 (the same numbers: one scale per 32
  values of a row); the tile is read from the shapes, so partial edge tiles work
  (mlx-vlm's own `sanitize` assumes full 128-row tiles). FP4 experts (e2m1, 1x32
  ue8m0 scales) become mxfp4 through mlx-vlm's `sanitize`, which also renames the
  DeepSeek names. `mtp.*` (the DSpark stages of -0731, the MTP block of the base
  model) is left to the drafters. Every tensor must land on a parameter.
* **A forward that equals decoding one token at a time.** mlx-vlm runs a block of up
  to 8 (`DECODE_BLOCK_SIZE`) tokens token by token inside attention, which gives the
  logits of one-token decoding; a longer block takes its prompt path, whose ratio-4
  KV compression pools differently. So a verify block of 9 .. MAX_DRAFT + 1 tokens is
  fed in pieces of 8, and speculative output stays the target's own.
* **Caches that roll back.** The sliding windows (mlx-vlm's `RotatingKVCache`) are
  taken over by `WindowKVCache`; the pooled layers (`PoolingCache`, updated in place)
  are restored from a copy and the kept tokens replayed (`mlx_spec.cache.Checkpoint`).
* **Sharding** (`mlx_spec.distributed`): `shard()` is mlx-vlm's tensor-parallel split
  (query heads, output projections and expert widths over the ranks, an `all_sum` after
  attention and after the MoE), after checks it lacks; `pipeline()` gives each rank
  consecutive layers for mlx-vlm's pipelined forward (rank 0 the last ones), split as
  evenly as the count allows (mlx-vlm 0.7.10's own `pipeline()` loses a layer when the
  ranks do not divide the layers: 43 over 2 ranks runs 42).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache import MAX_DRAFT, register_cache_types
from ..taps import in_pieces
from ..weights import check_fit, fp8_blocks_to_mxfp8, quantize_as_stored
from . import missing_extra

DROPPED = ("mtp.",)  # read by the drafters (DSpark stages, MTP block), not the trunk


def _vlm():
    """mlx-vlm's DeepSeek-V4 modules, with its cache types registered for rollback."""
    try:
        from mlx_vlm.models import cache as vlm_cache
        from mlx_vlm.models.deepseek_v4 import config as vlm_config
        from mlx_vlm.models.deepseek_v4 import language as vlm_language
        from mlx_vlm.models.linear import DECODE_BLOCK_SIZE, linear
    except ImportError as e:
        raise missing_extra("deepseek_v4", "mlx-vlm", e) from e
    pooling = vlm_cache.PoolingCache
    register_cache_types(
        rotating=[vlm_cache.RotatingKVCache], containers=[vlm_cache.CacheList],
        snapshots={pooling: ("buf_kv", "buf_gate", "remainder", "pooled")},
        copied={pooling: ("buf_kv", "buf_gate")}, positionless=[pooling])
    return vlm_config, vlm_language, DECODE_BLOCK_SIZE, linear


class DeepseekV4(nn.Module):
    """mlx-vlm's DeepSeek-V4 language model behind mlx-lm's model interface.

    Children: `model` (mlx-vlm's `DeepseekV4Model`: `embed_tokens`, `layers`, `norm`,
    `hc_head`) and `lm_head`. A decoder layer's output is the hyper-connection streams
    [B, T, hc_mult, H]; the final norm reads their `hc_head` collapse.
    """

    def __init__(self, language_model):
        super().__init__()
        _, self._language, self._piece, self._linear = _vlm()
        self.args = language_model.args
        self.model_type = "deepseek_v4"
        self.model = language_model.model
        self.lm_head = language_model.lm_head
        self.eval()  # mlx-vlm takes its token-by-token decode path only outside training

    # On a pipeline split, layer taps of other ranks are gathered where every rank holds the
    # last stage's hyper-connection streams again: the input of `hc_head` (the final norm
    # reads its collapse, a different shape from the layer taps).
    stage_gather_at = "hc_head"

    @property
    def layers(self):
        return self.model.pipeline_layers  # this rank's layers on a pipeline split

    def check_shard(self, size: int) -> None:
        """Refuse a tensor split over `size` ranks that mlx-vlm's `shard()` cannot make:
        whole query heads per output group on every rank, and whole quantization groups in
        every input it splits (the output projections' and the experts' down projections)."""
        a, layer = self.args, self.model.layers[0]
        if a.num_attention_heads % (a.o_groups * size):
            raise ValueError(f"deepseek_v4: {a.num_attention_heads} attention heads in "
                             f"{a.o_groups} output groups cannot be split over {size} ranks "
                             "(each group's heads must divide by the ranks); use --shard pipeline")
        split = {"attn.wo_a": (layer.attn.wo_a, a.num_attention_heads * a.head_dim // a.o_groups),
                 "ffn.shared_experts.down_proj": (layer.ffn.shared_experts.down_proj,
                                                  a.moe_intermediate_size * a.n_shared_experts),
                 "ffn.switch_mlp.down_proj": (layer.ffn.switch_mlp.down_proj, a.moe_intermediate_size)}
        for name, (module, width) in split.items():
            group = getattr(module, "group_size", 1)
            if width % (size * group):
                raise ValueError(f"deepseek_v4: {name} reads {width} values per row in quantization "
                                 f"groups of {group}, which {size} ranks cannot split into whole "
                                 "groups; use --shard pipeline")

    def shard(self, group) -> None:
        """mlx-vlm's tensor-parallel split of this instance (`check_shard` first), with each
        rank's attention sinks those of its own heads. mlx-vlm 0.7.10 splits the query
        projection group by group (rank r: the r-th part of every output group's heads) but
        the sinks in one piece (rank r: the r-th part of all heads), which gives heads other
        heads' sinks whenever `o_groups` > 1 (mlx-vlm's default: 8): found by this split's
        test, whose sharded logits moved by 5 without this."""
        size, rank = group.size(), group.rank()
        self.check_shard(size)
        sinks = [layer.attn.attn_sink for layer in self.model.layers]
        self._language.LanguageModel.shard(self, group)
        for layer, sink in zip(self.model.layers, sinks):
            layer.attn.attn_sink = sink.reshape(self.args.o_groups, size, -1)[:, rank].reshape(-1)

    def pipeline(self, group) -> None:
        """Consecutive layers per rank for mlx-vlm's pipelined forward, which runs the layers
        `start_idx:end_idx` of its list, receives from rank + 1 and sends to rank - 1 (so
        rank 0 holds the last layers), then `all_gather`s the last stage's output. The first
        ranks take one more layer when the ranks do not divide the layers; the other ranks'
        layers are dropped (never evaluated when loaded lazily)."""
        inner, size, rank = self.model, group.size(), group.rank()
        base, extra = divmod(len(inner.layers), size)
        counts = [base + (r < extra) for r in range(size)]
        start = sum(counts[rank + 1:])
        inner.pipeline_rank, inner.pipeline_size = rank, size
        inner.start_idx, inner.end_idx = start, start + counts[rank]
        inner.layers = [None] * start + inner.layers[start:start + counts[rank]]

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        n = inputs.shape[1]
        if cache is not None and self._piece < n <= MAX_DRAFT + 1:  # a verify block
            calls = [lambda i=i: self(inputs[:, i : i + self._piece], cache)
                     for i in range(0, n, self._piece)]
            return mx.concatenate(in_pieces(self, calls), axis=1)  # taps see one forward
        out = self._linear(self.lm_head, self.model(inputs, cache=cache))
        if getattr(self, "_mlx_spec_shard", None) is not None:
            # Sharded: queue the whole forward, its messages included, before anything else.
            # mlx-vlm's attention queues its outputs (`mx.async_eval`) while the graph is
            # built, so a later pipeline stage already waits in this forward's `recv` while
            # the earlier stage's `send` is still unbuilt or lazy (a replay after a rejection
            # stays lazy until the next step); an eager collective in between (the next
            # piece's sync check, the agreed draft length) would then meet that `recv`: ring
            # messages carry no tags (found by the pipeline test: it hung, or the check's
            # message arrived as a hidden state). Queued here, every rank runs this forward's
            # messages before any later one, in the same order.
            mx.async_eval(out)
        return out

    def make_cache(self) -> list:
        # mlx-vlm's own layout: a window per layer, plus pooled KV (and the indexer's) where
        # the layer compresses; mlx_spec.cache.prepare_cache makes the windows roll back.
        return self._language.LanguageModel.make_cache(self)


def _read(folder: Path) -> dict:
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update({k: v for k, v in mx.load(str(f)).items() if not k.startswith(DROPPED)})
    if not weights:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    return weights


def _repack_fp8(weights: dict) -> dict:
    """Block-scaled FP8 weights (e4m3 bytes, `.scale` tile grid) -> mxfp8 `.weight`/`.scales`.

    FP4 experts (one scale row per weight row) are left to mlx-vlm's sanitize."""
    out = dict(weights)
    for key, scale in weights.items():
        if not key.endswith(".scale"):
            continue
        wkey = key[: -len("scale")] + "weight"
        weight = weights.get(wkey)
        if weight is None or weight.dtype != mx.uint8 or scale.ndim != 2 or scale.shape[0] == weight.shape[0]:
            continue
        out[wkey], out[key + "s"] = fp8_blocks_to_mxfp8(key, weight, scale)
        del out[key]
    return out


def load_model(folder, config: dict, lazy: bool = False) -> DeepseekV4:
    """The trunk of a DeepSeek-V4 checkpoint folder (DeepSeek's tensor names). `lazy`: the
    weights are read when first evaluated (a sharded rank reads only its part)."""
    vlm_config, vlm_language, _, _ = _vlm()
    folder = Path(folder)
    text = {**config.get("text_config", config), "vision_n_layers": 0}
    language = vlm_language.LanguageModel(vlm_config.ModelConfig.from_dict(text))
    weights = language.sanitize(_repack_fp8(_read(folder)))
    quantize_as_stored(language, weights)
    check_fit(dict(tree_flatten(language.parameters())), weights, "DeepSeek-V4",
              "is this a complete DeepSeek-V4 checkpoint for its config.json?", where=f"{folder}: ")
    language.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(language.parameters())
    return DeepseekV4(language)


def load(folder, config: dict, lazy: bool = False):
    """(model, tokenizer) for a DeepSeek-V4 checkpoint folder (`TARGETS["deepseek_v4"]`)."""
    from mlx_lm.utils import load_tokenizer

    model = load_model(folder, config, lazy)
    return model, load_tokenizer(Path(folder), eos_token_ids=config.get("eos_token_id"))
