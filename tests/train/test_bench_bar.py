"""The BAR simulation runs, is deterministic per seed, and reports what the issue asks."""

from orchard.bench.bar import METHODS, SimulationParams, run


def test_simulation_is_deterministic_and_complete():
    params = SimulationParams(steps=6, batch=6)
    first, second = run(2, params), run(2, params)
    assert first["summary"] == second["summary"]
    assert set(first["summary"]) == set(METHODS)
    for method in METHODS:
        summary = first["summary"][method]
        assert summary["rollouts_per_informative_group"]["mean"] > 0
        assert 0 <= summary["informative_share"]["mean"] <= 1
    assert first["summary"]["dapo"]["informative_share"]["mean"] == 1.0  # it drops the rest
    assert first["summary"]["fixed_g"]["fallback_rate"] is None
    assert first["summary"]["bar_adaptive"]["group_balance"]["mean"] <= first["summary"]["bar_static"]["group_balance"]["mean"] + 1e-9
    assert set(first["targets"]) and set(first["ratios"])
