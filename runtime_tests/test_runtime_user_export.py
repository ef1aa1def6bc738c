"""Verify export directories given with ``--export-dir DIR`` or ``PIT_EXPORT_DIR``.

Run in your own CI after ``pit-deploy export``::

    pytest runtime_tests/test_runtime_user_export.py --export-dir out/my-export

Without a directory the parameter set is empty and pytest reports the test as skipped.
"""

from __future__ import annotations

from pit_deploy.evaluate.verify import verify_directory


def test_user_export(user_artifact, record_figures):
    """One artifact (runtime × mode × scheme) of the export, judged by its own scheme's bounds."""
    directory, runtime, mode, scheme = user_artifact
    report = verify_directory(directory, runtimes=[runtime], modes=[mode], dtypes=[scheme], record=False)
    r = report.result(runtime, mode, scheme)
    record_figures(f"{directory} {runtime}-{mode}-{scheme}", r)
    assert r.passed, f"{runtime}-{mode}-{scheme} failed: {'; '.join(r.failures)}"
