"""bench.sim_scale: the simulator's speed benchmark runs, and its instruments leave no trace."""
from __future__ import annotations

from bench import sim_scale
from router.routing.balancer import Balancer


def test_replay_times_the_last_decisions_and_puts_decide_back(capsys):
    decide = Balancer.__dict__["decide"]
    assert sim_scale.main(["--workers", "8", "--requests", "300", "--replay", "50"]) == 0
    out = capsys.readouterr().out
    assert "workers=8 requests=300" in out
    assert "Balancer.decide replayed:" in out and "(the last 50, best of 5)" in out
    assert Balancer.__dict__["decide"] is decide


def test_without_replay_nothing_is_recorded(capsys):
    decide = Balancer.__dict__["decide"]
    with sim_scale.recorded_decisions(0) as calls:
        assert Balancer.__dict__["decide"] is decide  # not even wrapped
    assert len(calls) == 0
    assert sim_scale.main(["--workers", "8", "--requests", "100"]) == 0
    assert "replayed" not in capsys.readouterr().out
