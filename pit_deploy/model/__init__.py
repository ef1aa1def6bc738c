"""The PIT model: the interface math (:mod:`.core`, imports nothing of the project), the
embedding/head modules that read it (:mod:`.modules`), the family adapters (:mod:`.families`),
assembling a PIT model (:mod:`.pit_model`) and inspecting any model's interface (:mod:`.inspect`).
"""
