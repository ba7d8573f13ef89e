"""`mlx-spec bench`: every decoding method side by side with mlx-lm, on prompt suites.

    mlx-spec bench                                   # SmolLM2 from the zoo, a few minutes
    mlx-spec bench --preset qwen-coder-draft --claims

Modules: `methods` (the table of methods), `harness` (fair timing), `summary`
(medians, paired speed-ups, the identical-output check), `cost` (the verify
cost curve, reused by adaptive k), `hardware`, `suites`, `claims`, `report`.
Importing this package stays light: mlx loads inside `run`.
"""

from .cli import add_arguments, run

__all__ = ["add_arguments", "run"]
