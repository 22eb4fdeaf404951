"""The conformance suite: every backend checked against the CPU reference (SPEC 4).

conformance/cases/<op>.py   case generators per op: smoke, realistic, adversarial, errors
conformance/compare.py      comparators per output (exact, top-k contracts, attention, ulp, ...)
conformance/manifest.py     a backend's expectations.yaml: strict xfails, skips, tolerance overrides
conformance/runner.py       one backend x the selected cases: claims, determinism, fallback detection
conformance/report.py       coverage matrix, JSON, JUnit XML, Markdown
conformance/cli.py          `glm5 conformance`
"""
