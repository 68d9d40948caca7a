"""The adaptive KL controller of Ziegler et al. 2019, checked against numbers worked by hand."""

import pytest

from ppokit.training.algo import AdaptiveKLController, FixedKLController


def test_adaptive_kl_update_rule_by_hand():
    # e = clip(KL / target - 1, -0.2, 0.2);  coef <- coef * (1 + e * n_steps / horizon)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert c.update(9.0, 256) == pytest.approx(0.1 * 1.00512)  # e = 0.5 clipped to 0.2: 0.2 * 256 / 10000
    assert c.update(6.6, 1000) == pytest.approx(0.100512 * 1.01)  # e = 0.1 inside the clip: 0.1 * 1000 / 10000
    assert c.update(0.0, 500) == pytest.approx(0.10151712 * 0.99)  # e = -1 clipped to -0.2
    assert c.update(6.0, 999) == pytest.approx(0.1005019488)  # on target: unchanged
    assert c.value == pytest.approx(0.1005019488)


def test_kl_controller_state_round_trips():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(9.0, 256)
    restored = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value
    assert restored.update(3.0, 100) == c.update(3.0, 100)
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 1000) == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05
