"""Model-native MTP heads: DeepSeek-V3 / GLM-4.x, Qwen3-Next / Qwen3.5 / 3.6, MiMo.

    drafter = mlx_spec.load_drafter(target_folder, model, kind="mtp")   # weights from the target
    drafter = mlx_spec.load_drafter(head_folder, model)                 # `convert head --format mtp`

See docs/mtp.md. `families` holds the per-family layouts, `head` the module,
`drafter` the Drafter, `load` the two loaders and the extraction they share.
"""

from .drafter import MTPDrafter
from .head import MTPConfig, MTPHead
from .load import build_head, extract, load_head_folder, load_mtp, probe

__all__ = ["MTPConfig", "MTPDrafter", "MTPHead", "build_head", "extract", "load_head_folder",
           "load_mtp", "probe"]
