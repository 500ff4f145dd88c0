"""Judges: is a stage's answer good enough to return, or should the next model answer?

``verdict`` holds what every judge shares (the candidate it sees, the verdict it gives, the
failure policy), then one module per kind: ``logprob`` (a low quantile of the per-token
probabilities), ``format`` (regex, JSON schema, and ``AllOf`` to combine), ``verifier`` (an
HTTP endpoint ``{prompt, response} -> {accept, score}``) and ``llm_judge`` (a fleet model asked
with a rubric; its cost counts). The pure ones do no I/O.
"""
