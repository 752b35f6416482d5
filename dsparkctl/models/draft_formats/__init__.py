"""Draft checkpoint formats: one registry, one canonical draft (base.py, registry.py)."""

from dsparkctl.models.draft_formats.base import BORROWED, CanonicalDraft, DraftFormat, FileFacts
from dsparkctl.models.draft_formats.registry import (BY_KEY, DROPPABLE, FORMATS, apply_drops, check_drops, detect,
                                                     format_named, plan, read, read_tensors, tensor_names,
                                                     with_borrowed, write)

__all__ = ["BORROWED", "BY_KEY", "DROPPABLE", "FORMATS", "CanonicalDraft", "DraftFormat", "FileFacts", "apply_drops",
           "check_drops", "detect", "format_named", "plan", "read", "read_tensors", "tensor_names", "with_borrowed", "write"]
