"""The evaluation math: curve points, AUC, APGR and CPT as RouteLLM defines them, baselines, split."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.cascade_eval.dataset import Question, split_halves
from bench.cascade_eval.metrics import (CurvePoint, apgr, auc, best_gain_over_random, cascade_curve, cpt, pgr, point,
                                        random_accuracy)


def _pts(*xy):
    return [CurvePoint(math.nan, x, y) for x, y in xy]


def test_a_cascade_curve_escalates_the_scores_below_each_threshold():
    # Four questions; the judge's scores of the weak answers, and who is right.
    scores = [0.1, 0.5, 0.5, 0.9]
    weak = [False, True, False, True]
    strong = [True, True, True, False]
    curve = cascade_curve(scores, weak, strong)
    assert [(p.threshold, p.strong_share, p.accuracy) for p in curve] == [
        (0.1, 0.0, 0.5),        # nothing below 0.1: always weak
        (0.5, 0.25, 0.75),      # q0 escalates, the strong model gets it right
        (0.9, 0.75, 1.0),       # q0-q2 escalate, q3 keeps its right weak answer
        (math.inf, 1.0, 0.75)]  # always strong
    # AUC = .25(.5+.75)/2 + .5(.75+1)/2 + .25(1+.75)/2 = .8125; APGR = (.8125-.5)/(.75-.5).
    assert auc(curve) == pytest.approx(0.8125)
    assert apgr(curve, 0.5, 0.75) == pytest.approx(1.25)
    assert cpt(curve, 0.5, 0.75, 0.5) == pytest.approx(0.125)
    assert cpt(curve, 0.5, 0.75, 0.8) == pytest.approx(0.2)


def test_apgr_and_cpt_agree_with_routellms_numpy_formulas_on_a_monotone_curve():
    curve = _pts((0.0, 0.5), (0.5, 0.8), (1.0, 0.9))
    weak, strong = 0.5, 0.9
    xs, ys = np.array([0.0, 0.5, 1.0]), np.array([0.5, 0.8, 0.9])
    routellm_auc = np.trapezoid(ys, xs)
    routellm_apgr = (routellm_auc - np.trapezoid(np.full(3, weak), xs)) / (
        np.trapezoid(np.full(3, strong), xs) - np.trapezoid(np.full(3, weak), xs))
    assert apgr(curve, weak, strong) == pytest.approx(routellm_apgr) == pytest.approx(0.625)
    for x, expected in ((0.5, 1 / 3), (0.8, 0.6), (0.2, np.interp(weak + 0.2 * (strong - weak), ys, xs))):
        assert cpt(curve, weak, strong, x) == pytest.approx(np.interp(weak + x * (strong - weak), ys, xs))
        assert cpt(curve, weak, strong, x) == pytest.approx(expected)


def test_random_routing_is_the_straight_line_apgr_one_half_cpt_x():
    line = _pts(*[(s, random_accuracy(s, 0.6, 0.9)) for s in (0.0, 0.25, 0.5, 0.75, 1.0)])
    assert apgr(line, 0.6, 0.9) == pytest.approx(0.5)
    assert cpt(line, 0.6, 0.9, 0.5) == pytest.approx(0.5) and cpt(line, 0.6, 0.9, 0.8) == pytest.approx(0.8)


def test_cpt_takes_the_first_crossing_of_a_non_monotone_curve():
    curve = _pts((0.0, 0.5), (0.3, 0.8), (0.6, 0.7), (1.0, 0.9))
    assert cpt(curve, 0.5, 0.9, 0.5) == pytest.approx(0.3 * 0.2 / 0.3)
    assert cpt(_pts((0.0, 0.5), (1.0, 0.6)), 0.5, 0.9, 0.8) is None


def test_a_point_counts_the_strong_answers_of_the_escalated_questions():
    p = point([True, False, False], [False, True, False], [True, False, True])
    assert (p.strong_share, p.accuracy) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    with pytest.raises(ValueError):
        point([], [], [])
    assert pgr(0.7, 0.5, 0.9) == pytest.approx(0.5)


def test_the_chosen_threshold_beats_random_routing_by_the_most():
    curve = _pts((0.0, 0.5), (0.1, 0.6), (0.4, 0.8), (1.0, 0.9))
    # PGR - share: 0, 0.25 - 0.1 = 0.15, 0.75 - 0.4 = 0.35, 0.
    assert best_gain_over_random(curve, 0.5, 0.9).strong_share == 0.4


def test_the_split_is_seeded_disjoint_and_covers_every_question():
    questions = [Question(i, f"q{i}", "", "", True, True) for i in range(11)]
    tune, test = split_halves(questions, seed=3)
    assert (len(tune), len(test)) == (5, 6)
    assert sorted(q.index for q in tune + test) == list(range(11))
    assert split_halves(questions, seed=3) == (tune, test)
    assert split_halves(questions, seed=4) != (tune, test)
