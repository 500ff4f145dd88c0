"""The virtual models' Prometheus metrics: what each stage did, how long judges took, and
what the virtual models' requests cost.

Labels are bounded by the configuration (virtual model, stage model, judge name, outcome),
never by the request. Cost per *real* model (actual and no-cache) is the ledger's
(``prefixlb_router_cost_usd_total``, :mod:`router.cost.metrics`); here is the cost per virtual
model, the judges' own spending included.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.virtual_models.cascade import CascadeResult, StageRecord

JUDGE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VirtualModelMetrics:
    """Counters and histograms registered in the router's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.stage_outcomes = Counter(
            "prefixlb_router_cascade_stage_outcomes_total",
            "Cascade stages by outcome: accepted, escalated, final, stage_error, judge_unavailable",
            ["virtual_model", "model", "outcome"], registry=registry)
        self.judge_errors = Counter(
            "prefixlb_router_cascade_judge_errors_total",
            "Judges that could not decide (their on_error policy decided instead), by reason",
            ["virtual_model", "judge", "reason"], registry=registry)
        self.judge_seconds = Histogram(
            "prefixlb_router_cascade_judge_seconds", "Wall time of a judge's verdict",
            ["virtual_model", "judge"], buckets=JUDGE_BUCKETS, registry=registry)
        self.answered = Counter(
            "prefixlb_router_virtual_model_requests_total",
            "Requests a virtual model answered, by the real model that answered",
            ["virtual_model", "model"], registry=registry)
        self.failed = Counter(
            "prefixlb_router_virtual_model_failures_total",
            "Requests a virtual model could not answer, by error code",
            ["virtual_model", "code"], registry=registry)
        self.cost = Counter(
            "prefixlb_router_virtual_model_cost_usd_total",
            "Cost of the virtual models' requests in USD: a cascade's stages and judges, a route's "
            "non-streamed answers (its streams are in the ledger under their real model)",
            ["virtual_model"], registry=registry)
        self.route_decisions = Counter(
            "prefixlb_router_route_decisions_total",
            "Route virtual models' decisions: the model and why (rule, classifier, classifier_error, default)",
            ["virtual_model", "model", "reason"], registry=registry)

    def observe_stages(self, virtual_model: str, stages: list[StageRecord]) -> None:
        """Count every stage's outcome and its judge's latency or failure."""
        for stage in stages:
            self.stage_outcomes.labels(virtual_model, stage.model, stage.outcome).inc()
            verdict = stage.verdict
            if verdict is not None:
                self.judge_seconds.labels(virtual_model, verdict.judge).observe(verdict.latency_s)
                if verdict.failed:
                    self.judge_errors.labels(virtual_model, verdict.judge, verdict.reason).inc()

    def observe_result(self, result: CascadeResult) -> None:
        """A cascade that answered: its stages, the answering model, its cost."""
        self.observe_stages(result.cascade, result.stages)
        self.answered.labels(result.cascade, result.answered_by).inc()
        cost = result.cost_usd
        if cost is not None:
            self.cost.labels(result.cascade).inc(cost)
