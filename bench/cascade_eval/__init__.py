"""``prefixlb bench cascade``: judges and routing policies evaluated on recorded model answers.

``dataset`` loads a RouteLLM-style responses CSV and splits it in halves (one to choose each
judge's threshold, one to report on); ``arithmetic`` is an honest GSM8K verifier (it checks
the answer's own arithmetic, never the label); ``metrics`` the accuracy-vs-strong-share curve,
APGR and CPT exactly as RouteLLM defines them, and the baselines; ``offline`` runs the judges
on the recorded answers; ``fleet`` starts the real router in front of two recorded-answer
workers and ``http_run`` measures every policy through it over HTTP (the default of
``prefixlb bench cascade``); ``report`` writes summary.json, report.md and the curve's PNG.
"""
