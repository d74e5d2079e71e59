"""Training entry points for drafters: data regeneration by the target, feature extraction, distillation."""
