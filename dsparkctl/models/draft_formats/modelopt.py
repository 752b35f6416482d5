"""(being written)"""

from __future__ import annotations

from dsparkctl.models.draft_formats.base import DraftFormat

MODELOPT = DraftFormat(key="modelopt", title="modelopt", trainer="modelopt", claims_config=lambda c: False, claims_tensors=lambda n: False)
