"""Files: one atomic writer and digests (:mod:`.fs`), export manifests (:mod:`.manifest`) and
hub ids (:mod:`.hub`) — standard library only, importable on a device without torch — plus the
checkpoint format (:mod:`.checkpoint`), model sources (:mod:`.sources`), GGUF files and their
converted-model cache (:mod:`.gguf_files`) and ``metrics.jsonl`` (:mod:`.metrics`). See
``docs/conventions.md`` and ``docs/manifest.md``.

Nothing is imported here, so ``import pit_deploy.io.manifest`` stays light.
"""
