"""Training a draft by self-distillation: recipe, data from the target, the loop, checkpoints, export."""
