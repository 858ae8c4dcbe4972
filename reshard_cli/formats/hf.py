"""The checkpoint's own storage (`format: hf`, the default): every rank keeps its boxes of the checkpoint's
tensors under their own names, so the layout says everything (meshes and placement rules) and a live model's
tensors are passed by checkpoint name as they are."""
from __future__ import annotations

from reshard_cli.formats.base import Format

FORMAT = Format(name="hf", description="the checkpoint's own names and shapes; placements written in the layout")
