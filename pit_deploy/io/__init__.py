"""Files: one atomic writer and digests (:mod:`.fs`), export manifests (:mod:`.manifest`) —
both standard library only, importable on a device without torch — plus the checkpoint format
(:mod:`.checkpoint`) and model sources (:mod:`.sources`), which need torch and transformers.

Nothing is imported here, so ``import pit_deploy.io.manifest`` stays light.
"""
