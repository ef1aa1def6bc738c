"""Analysis of a model's token interface: diagnostics (:mod:`.diagnostics`), logit-lens probes
(:mod:`.probe`) and plots (:mod:`.plotting`). Definitions: ``docs/definitions.md``."""
