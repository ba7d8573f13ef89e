"""DSpark inside DeepSeek-V4 checkpoints: the `mtp.{0,1,2}.*` stages.

    drafter = mlx_spec.load_drafter(target_folder, model, kind="dspark")
    mlx-spec generate --model TARGET_FOLDER --draft dspark ...

The folder is the target's own checkpoint (DeepSeek names, `dspark_*` fields in
config.json); the target must be loaded by mlx-lm's `deepseek_v41` model (mlx-lm
0.32.2 loads no real V4-Flash-0731 or V4.1-Flash checkpoint). Two variants, "0731"
and "v41", picked by the tensor names: `net` holds the stages (`flash` the 0731
arithmetic), `drafter` the Drafter, `load` the weight reading (`probe` is what
`TARGET_PROBES["dspark"]` ends up calling). Sources: DeepSeek's V4 reference
`inference/model.py` (`DSparkBlock`, `Transformer.forward_spec`) and vLLM's
`vllm/models/deepseek_v4/nvidia/dspark.py`; docs/dflash.md says which rule comes from where.
"""

from .drafter import V4DSparkDrafter, tap_ids
from .load import native_name, probe, stage_weights
from .net import DSparkStages, StageContext, stage_args

__all__ = ["DSparkStages", "StageContext", "V4DSparkDrafter", "native_name", "probe",
           "stage_args", "stage_weights", "tap_ids"]
