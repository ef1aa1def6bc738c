"""``pit-deploy run``: run recipes (:mod:`.recipe`), the stages and their order
(:mod:`.pipeline`), stage records that let a rerun skip what is up to date (:mod:`.stage_records`),
the greedy answers (:mod:`.answers`) and the report (:mod:`.report`). See ``docs/run.md`` and
``docs/recipes.md``.
"""
